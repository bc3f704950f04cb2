"""Pacing of writes to the API server, pure and on a clock passed in (tests, bench/fleet_sim.py and the programs
drive the same classes): a token bucket, and the write scheduler of the node agent's writers (debounce, a bucket,
a back-off gate). The controller paces its evictions with the bucket alone."""

from __future__ import annotations

import math

from plugin.backoff import Backoff


class TokenBucket:
    """``capacity`` tokens, one more every ``interval_s``. Capacity 1 means "at most one per interval".

    Kept as the time the bucket is next full (``_full_at``), not as a count of tokens: a time compares exactly with
    the deadlines the callers compute from it, where a fraction of a token refilled over a wall-clock time (about
    1.7e9 s) is off by more than a rounding margin, and a caller waiting for the next token would wake just before
    it, again and again."""

    def __init__(self, interval_s: float, capacity: float = 1.0, now: float = 0.0) -> None:
        self.interval = interval_s
        self.capacity = capacity
        self._full_at = now

    def available_at(self, now: float) -> float:
        return max(now, self._full_at - (self.capacity - 1.0) * self.interval)

    def take(self, now: float) -> bool:
        if self.available_at(now) > now + 1e-9 * self.interval:
            return False
        self._full_at = max(self._full_at, now) + self.interval
        return True

    def refund(self) -> None:
        """Give back a token whose write failed: the back-off, not the bucket, paces retries."""
        self._full_at -= self.interval  # a bucket full before now holds no more than its capacity (see take)


class WriteScheduler:
    """When to write: debounce after the first unwritten change, a token bucket, and a back-off gate."""

    def __init__(self, debounce_s: float, min_interval_s: float, backoff: Backoff, now: float = 0.0) -> None:
        self.debounce = debounce_s
        self.bucket = TokenBucket(min_interval_s, 1.0, now)
        self.backoff = backoff
        self.pending_since: float | None = None
        self.blocked_until = -math.inf

    def changed(self, now: float) -> None:
        """Something we want differs from what the server has (idempotent while it stays so)."""
        if self.pending_since is None:
            self.pending_since = now

    def settled(self) -> None:
        """What we want is what the server has: nothing to write (e.g. a flap came back within the debounce)."""
        self.pending_since = None

    def due_at(self, now: float) -> float:
        if self.pending_since is None:
            return math.inf
        return max(self.pending_since + self.debounce, self.bucket.available_at(now), self.blocked_until)

    def try_start(self, now: float) -> bool:
        return self.due_at(now) <= now and self.bucket.take(now)

    def succeeded(self) -> None:
        self.pending_since = None
        self.backoff.reset()

    def failed(self, now: float, retry_after: float | None = None) -> float:
        self.bucket.refund()
        delay = self.backoff.next_delay(retry_after)
        self.blocked_until = now + delay
        return delay

    def blocked(self, now: float) -> bool:
        return now < self.blocked_until
