"""The one back-off formula every retry loop uses: the kubelet registration loop, the API-server writers, the
PodResources lookups and the evictions.

The n-th failure in a row waits ``initial * 2^(n-1)``, capped at ``maximum``. With ``jitter`` the wait is drawn
uniformly from the upper half of that ("equal jitter"), so a fleet that lost its API server at the same moment does
not come back in lockstep; a local peer (the kubelet) needs no jitter. A server's ``Retry-After`` is honoured up to
the cap.
"""

from __future__ import annotations

import random

# The jitter's draws when no generator is given: one for all. A generator of its own per back-off is 2.5 KB, and the
# fleet controller keeps a back-off per Node (50,000 of them, issue 27).
_RNG = random.Random()


class Backoff:
    __slots__ = ("_rng", "failures", "initial", "jitter", "maximum")

    def __init__(self, initial_s: float, maximum_s: float, jitter: bool = True,
                 rng: random.Random | None = None) -> None:
        self.initial = initial_s
        self.maximum = maximum_s
        self.jitter = jitter
        self.failures = 0
        self._rng = rng or _RNG

    def next_delay(self, retry_after: float | None = None) -> float:
        """Count one more failure and return how long to wait before the next attempt."""
        self.failures += 1
        d = min(self.maximum, self.initial * 2.0 ** min(self.failures - 1, 30))
        delay = d / 2 + self._rng.uniform(0, d / 2) if self.jitter else d
        if retry_after is not None:
            delay = max(delay, min(retry_after, self.maximum))
        return delay

    def reset(self) -> int:
        """End the streak; return how many failures it had."""
        n, self.failures = self.failures, 0
        return n
