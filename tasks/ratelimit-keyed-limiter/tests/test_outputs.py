import pytest

import ratelimit
from ratelimit import ManualClock


def make(**kw):
    clock = ManualClock()
    kw.setdefault("rate", 1)
    kw.setdefault("capacity", 2)
    return ratelimit.KeyedLimiter(clock=clock, **kw), clock


def test_exported():
    assert "KeyedLimiter" in ratelimit.__all__


def test_keys_are_independent():
    lim, clock = make()
    assert [lim.try_acquire("a") for _ in range(3)] == [True, True, False]
    assert [lim.try_acquire("b") for _ in range(3)] == [True, True, False]
    clock.advance(1.0)
    assert lim.try_acquire("a") and not lim.try_acquire("a")
    assert len(lim) == 2


def test_n_tokens():
    lim, clock = make(rate=2, capacity=5)
    assert lim.try_acquire("k", 5)
    assert not lim.try_acquire("k", 1)
    clock.advance(1.5)
    assert lim.try_acquire("k", 3)
    assert not lim.try_acquire("k", 0.5)


def test_lru_eviction():
    lim, clock = make(max_keys=2)
    lim.try_acquire("a"); lim.try_acquire("a")
    lim.try_acquire("b"); lim.try_acquire("b")
    assert not lim.try_acquire("a")          # a is now most recently used
    lim.try_acquire("c")                     # evicts b
    assert len(lim) == 2
    assert not lim.try_acquire("a")          # a survived with its empty bucket
    assert lim.try_acquire("b") and lim.try_acquire("b")  # b came back full
    assert len(lim) == 2


def test_default_max_keys_and_clock_shared():
    clock = ManualClock()
    lim = ratelimit.KeyedLimiter(rate=1, capacity=1, clock=clock)
    for i in range(1000):
        assert lim.try_acquire(i)
    assert len(lim) == 1000
    assert not lim.try_acquire(0)
    lim.try_acquire("new")
    assert len(lim) == 1000
    clock.advance(1)
    assert lim.try_acquire(0)
