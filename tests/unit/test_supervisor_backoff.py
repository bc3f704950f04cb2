"""The supervisor's back-off: exponential with a cap, and a log line per streak (or changed reason, or doubling
streak), never one per attempt."""

from __future__ import annotations

from plugin.kubelet.supervisor import FailureStreak


def test_delays_double_up_to_the_cap_and_a_success_starts_over() -> None:
    b = FailureStreak(initial_s=0.1, max_s=1.0)
    delays = [b.failed("EROFS")[0] for _ in range(7)]
    assert delays == [0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    assert b.succeeded() == 7
    assert b.failed("EROFS") == (0.1, True)


def test_a_streak_is_logged_once_then_at_doubling_points_and_on_a_new_reason() -> None:
    b = FailureStreak(initial_s=0.1, max_s=5.0)
    logged = [n for n in range(1, 101) if b.failed("bind refused")[1]]
    assert logged == [1, 8, 16, 32, 64]
    assert b.failed("read-only file system")[1]  # a different reason is news
    assert not b.failed("read-only file system")[1]
