"""Pacing of writes to the API server, pure and on a clock passed in (tests, bench/fleet_sim.py and the programs
drive the same classes): a token bucket, and the write scheduler of the node agent's writers (debounce, a bucket,
a back-off gate). The controller paces its evictions with the bucket alone."""

from __future__ import annotations

import math

from plugin.backoff import Backoff


class TokenBucket:
    """``capacity`` tokens, one more every ``interval_s``. Capacity 1 means "at most one per interval"."""

    def __init__(self, interval_s: float, capacity: float = 1.0, now: float = 0.0) -> None:
        self.interval = interval_s
        self.capacity = capacity
        self._tokens = capacity
        self._at = now

    def _refill(self, now: float) -> None:
        if now > self._at:
            self._tokens = min(self.capacity, self._tokens + (now - self._at) / self.interval)
            self._at = now

    def available_at(self, now: float) -> float:
        self._refill(now)
        if self._tokens >= 1.0:
            return now
        return now + (1.0 - self._tokens) * self.interval

    def take(self, now: float) -> bool:
        self._refill(now)
        if self._tokens >= 1.0 - 1e-9:
            self._tokens = max(0.0, self._tokens - 1.0)
            return True
        return False

    def refund(self) -> None:
        """Give back a token whose write failed: the back-off, not the bucket, paces retries."""
        self._tokens = min(self.capacity, self._tokens + 1.0)


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
