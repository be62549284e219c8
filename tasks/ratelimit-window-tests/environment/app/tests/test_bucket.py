from ratelimit import ManualClock, TokenBucket


def test_starts_full():
    b = TokenBucket(rate=1, capacity=3, clock=ManualClock())
    assert [b.try_acquire() for _ in range(4)] == [True, True, True, False]
