"""Sliding-window rate limits, counted as Feishu counts them."""

from __future__ import annotations

from megatrace.alertbot.ratelimit import RateLimiter

FIVE_PER_SECOND = [("bot", 5.0, 1.0)]


def test_a_full_window_makes_the_next_request_wait() -> None:
    limiter = RateLimiter()
    assert [limiter.acquire(FIVE_PER_SECOND, 10.0 + i / 10) for i in range(5)] == [0.0] * 5
    assert limiter.acquire(FIVE_PER_SECOND, 10.5) == 0.5
    assert limiter.acquire(FIVE_PER_SECOND, 11.0) == 0.0


def test_a_request_that_finished_late_counts_from_when_it_finished() -> None:
    """Feishu counts a request when it arrives: one slowed on its way counts later than its slot."""
    limiter = RateLimiter()
    assert limiter.acquire(FIVE_PER_SECOND, 10.0) == 0.0
    limiter.settle(FIVE_PER_SECOND, 10.0, 10.6)
    for i in range(1, 5):
        assert limiter.acquire(FIVE_PER_SECOND, 10.6 + i / 10) == 0.0
        limiter.settle(FIVE_PER_SECOND, 10.6 + i / 10, 10.6 + i / 10)
    assert abs(limiter.acquire(FIVE_PER_SECOND, 11.2) - 0.4) < 1e-9  # not free at 11.0, as the slot was
    assert limiter.acquire(FIVE_PER_SECOND, 11.6) == 0.0


def test_settle_of_an_unknown_request_changes_nothing() -> None:
    limiter = RateLimiter()
    limiter.settle(FIVE_PER_SECOND, 3.0, 4.0)
    assert limiter.acquire(FIVE_PER_SECOND, 3.0) == 0.0
    limiter.settle(FIVE_PER_SECOND, 2.0, 9.0)
    assert [limiter.acquire(FIVE_PER_SECOND, 3.0) for _ in range(5)] == [0.0] * 4 + [1.0]
