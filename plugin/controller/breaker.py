"""The circuit breaker: never more than a fraction of the GPU nodes, nor more than a set number of nodes, out of
service by our hand.

One bad driver roll-out or a broken monitoring stack makes many nodes look failed at once; quarantining them all
would take the fleet down. So quarantines proceed only while the controller's own quarantined count is under
``limit(gpu_nodes)``. The first candidate refused for that opens the breaker, and while it is open nothing more is
quarantined, even when a release makes room: the fleet is in a state a person should look at. It closes by itself
when the demand (quarantined plus waiting candidates) fits under the limit again, that is when the failure receded,
or when an operator resets it; then quarantines resume, and it opens again if the limit is crossed again.

Pure: the reconciler passes counts and the time. The state round-trips through JSON so that it lives on the
leader-election Lease and a new leader starts from the same breaker.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace

OPEN = "open"
CLOSED = "closed"


def fraction_limit(max_fraction: float, gpu_nodes: int) -> int:
    """The fraction rounded down, but one at least, so that a small cluster can quarantine its one bad node."""
    if gpu_nodes <= 0:
        return 0
    return max(1, math.floor(max_fraction * gpu_nodes + 1e-9))


def limit_for(max_fraction: float, gpu_nodes: int, max_nodes: int = 0) -> int:
    """How many GPU nodes may be quarantined: the fraction's limit, or the absolute cap when that is smaller
    (``max_nodes`` 0: no cap)."""
    limit = fraction_limit(max_fraction, gpu_nodes)
    return min(limit, max_nodes) if max_nodes > 0 else limit


@dataclass(frozen=True)
class BreakerState:
    state: str = CLOSED
    since: str = ""  # RFC 3339, when it last changed state
    limit: int = 0
    gpu_nodes: int = 0
    quarantined: int = 0
    blocked: int = 0
    reason: str = ""
    reset_seen: str = ""  # the last operator reset value acted on
    max_nodes: int = 0  # the absolute cap in force (--max-quarantined-nodes), 0: none

    def to_json(self) -> str:
        doc = {"state": self.state, "since": self.since, "limit": self.limit, "gpuNodes": self.gpu_nodes,
               "quarantined": self.quarantined, "blocked": self.blocked, "reason": self.reason,
               "resetSeen": self.reset_seen, "maxNodes": self.max_nodes}
        return json.dumps(doc, separators=(",", ":"))

    @classmethod
    def from_json(cls, raw: str | None) -> BreakerState:
        if not raw:
            return cls()
        try:
            doc = json.loads(raw)
        except ValueError:
            return cls()
        if not isinstance(doc, dict):
            return cls()
        state = doc.get("state") if doc.get("state") in (OPEN, CLOSED) else CLOSED

        def num(key: str) -> int:
            v = doc.get(key)
            return v if isinstance(v, int) and not isinstance(v, bool) else 0

        return cls(state=str(state), since=str(doc.get("since") or ""), limit=num("limit"),
                   gpu_nodes=num("gpuNodes"), quarantined=num("quarantined"), blocked=num("blocked"),
                   reason=str(doc.get("reason") or ""), reset_seen=str(doc.get("resetSeen") or ""),
                   max_nodes=num("maxNodes"))


class Breaker:
    def __init__(self, max_fraction: float, state: BreakerState | None = None, max_nodes: int = 0) -> None:
        self.max_fraction = max_fraction
        self.max_nodes = max_nodes
        # The cap in force is this process's setting, whatever an earlier leader recorded.
        self.state = replace(state or BreakerState(), max_nodes=max_nodes)
        self.trips = 0

    @property
    def is_open(self) -> bool:
        return self.state.state == OPEN

    def limit(self, gpu_nodes: int) -> int:
        return limit_for(self.max_fraction, gpu_nodes, self.max_nodes)

    def _limit_text(self, gpu_nodes: int) -> str:
        """Which setting makes the limit: the operator must know which one to raise."""
        by_fraction = fraction_limit(self.max_fraction, gpu_nodes)
        if 0 < self.max_nodes < by_fraction:
            return (f"--max-quarantined-nodes {self.max_nodes}; --max-quarantined-fraction {self.max_fraction:.0%} "
                    f"would allow {by_fraction}")
        return f"{self.max_fraction:.0%}, --max-quarantined-fraction"

    def allows(self, quarantined: int, gpu_nodes: int) -> bool:
        return not self.is_open and quarantined < self.limit(gpu_nodes)

    def trip(self, now: str, quarantined: int, candidates: int, gpu_nodes: int) -> bool:
        """A candidate was refused for the limit: open (True when it was closed until now)."""
        was_open = self.is_open
        limit = self.limit(gpu_nodes)
        reason = (f"{quarantined + candidates} GPU nodes call for quarantine, {quarantined} already are; the limit "
                  f"is {limit} of {gpu_nodes} ({self._limit_text(gpu_nodes)})")
        self.state = replace(self.state, state=OPEN, since=self.state.since if was_open else now, limit=limit,
                             gpu_nodes=gpu_nodes, quarantined=quarantined, blocked=candidates, reason=reason)
        if not was_open:
            self.trips += 1
        return not was_open

    def settle(self, now: str, quarantined: int, candidates: int, gpu_nodes: int) -> bool:
        """Update the counts; close when the demand fits under the limit again (True when it closed now)."""
        limit = self.limit(gpu_nodes)
        s = replace(self.state, limit=limit, gpu_nodes=gpu_nodes, quarantined=quarantined, blocked=candidates)
        if s.state == OPEN and quarantined + candidates <= limit:
            self.state = replace(s, state=CLOSED, since=now, blocked=0,
                                 reason=f"demand {quarantined + candidates} fits the limit {limit} again")
            return True
        self.state = s
        return False

    def reset(self, now: str, token: str) -> bool:
        """An operator's reset (a new value of the Lease's breaker-reset annotation, or the flag): close now."""
        if token == self.state.reset_seen:
            return False
        was_open = self.is_open
        self.state = replace(self.state, state=CLOSED, since=now if was_open else self.state.since, blocked=0,
                             reason=f"reset by an operator ({token})" if was_open else self.state.reason,
                             reset_seen=token)
        return was_open
