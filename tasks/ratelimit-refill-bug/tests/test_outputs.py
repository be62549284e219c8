import pytest

from ratelimit import ManualClock, RateLimited, TokenBucket


def test_burst_after_idle_is_capped():
    clock = ManualClock()
    b = TokenBucket(rate=5, capacity=3, clock=clock)
    clock.advance(3600)
    granted = sum(b.try_acquire() for _ in range(20))
    assert granted == 3
    assert b.available == pytest.approx(0.0)


def test_fractional_refill_polling():
    clock = ManualClock()
    b = TokenBucket(rate=8, capacity=1, clock=clock)
    assert b.try_acquire()
    granted = 0
    for _ in range(32):  # 2 seconds of 62.5 ms polls (exact in binary floating point)
        clock.advance(0.0625)
        granted += b.try_acquire()
    assert 15 <= granted <= 16


def test_available_is_exact():
    clock = ManualClock(100.0)
    b = TokenBucket(rate=2, capacity=10, clock=clock)
    for _ in range(10):
        assert b.try_acquire()
    clock.advance(1.25)
    assert b.available == pytest.approx(2.5)
    clock.advance(0.3)
    assert b.available == pytest.approx(3.1)
    clock.advance(100)
    assert b.available == pytest.approx(10.0)


def test_retry_after():
    clock = ManualClock()
    b = TokenBucket(rate=4, capacity=2, clock=clock)
    b.acquire(2)
    clock.advance(0.125)
    with pytest.raises(RateLimited) as err:
        b.acquire(2)
    assert err.value.retry_after == pytest.approx(0.375)
    clock.advance(0.375)
    b.acquire(2)


def test_partial_tokens_not_lost_between_calls():
    clock = ManualClock()
    b = TokenBucket(rate=1, capacity=5, clock=clock)
    for _ in range(5):
        b.try_acquire()
    for _ in range(10):
        clock.advance(0.3)
        b.available  # many small observations must not drop time
    assert b.available == pytest.approx(3.0)
