import random

import pytest

from retrying import Backoff, RetryError, retry


def test_schedule_and_cap():
    b = Backoff(base=0.5, factor=2, max_delay=3)
    assert [b.delay(n) for n in range(1, 6)] == [0.5, 1.0, 2.0, 3, 3]


def test_jitter_only_reduces():
    b = Backoff(base=1, factor=2, max_delay=64, jitter=0.5, rng=random.Random(0))
    ds = [b.delay(n) for n in range(1, 8)]
    for n, d in enumerate(ds, 1):
        full = min(64, 2 ** (n - 1))
        assert 0.5 * full <= d <= full
    assert any(d < min(64, 2 ** (n - 1)) for n, d in enumerate(ds, 1))


def test_attempts_and_sleeps():
    slept, calls = [], []

    def boom():
        calls.append(1)
        raise OSError("x")

    with pytest.raises(RetryError) as err:
        retry(boom, attempts=3, on=(OSError,), backoff=Backoff(base=1, factor=10, max_delay=1000), sleep=slept.append)
    assert len(calls) == 3
    assert slept == [1, 10]
    assert err.value.attempts == 3 and isinstance(err.value.last, OSError)


def test_success_after_failures():
    state = {"n": 0}

    def f():
        state["n"] += 1
        if state["n"] < 2:
            raise OSError
        return 42

    assert retry(f, attempts=2, on=(OSError,), sleep=lambda s: None) == 42


def test_other_exceptions_propagate():
    calls = []

    def f():
        calls.append(1)
        raise KeyError("k")

    with pytest.raises(KeyError):
        retry(f, attempts=5, on=(OSError,), sleep=lambda s: None)
    assert len(calls) == 1
