"""The token bucket at wall-clock times, as the controller paces its evictions with it: the time it hands out for
the next token is the time it gives that token (the bucket's other behaviour is in test_annotations.py)."""

from __future__ import annotations

import pytest

from plugin.kube.ratelimit import TokenBucket

WALL = 1_767_225_600.0  # 2026-01-01, where a second has few bits of fraction left


@pytest.mark.parametrize("interval", [60 / 7, 60 / 45, 0.1, 3.0])
def test_the_next_token_comes_at_the_time_the_bucket_named(interval: float) -> None:
    b = TokenBucket(interval)
    now = WALL
    for _ in range(50):
        assert b.take(now)
        assert not b.take(now)
        now = b.available_at(now)
        assert now > WALL


def test_a_refund_gives_back_no_more_than_the_capacity() -> None:
    b = TokenBucket(10.0)
    assert b.take(WALL)
    b.refund()
    b.refund()  # already full
    assert b.take(WALL) and not b.take(WALL)
    assert b.available_at(WALL) == WALL + 10.0
