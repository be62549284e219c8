import random

import pytest

from retrying import Backoff, RetryError, retry


def test_schedule():
    b = Backoff(base=0.5, factor=2, max_delay=5)
    assert [b.delay(n) for n in range(1, 7)] == [0.5, 1.0, 2.0, 4.0, 5, 5]
    assert Backoff(base=1, factor=1, max_delay=3).delay(50) == 1
    assert Backoff(base=10, factor=3, max_delay=2).delay(1) == 2


@pytest.mark.parametrize("n", [1023, 1024, 1025, 2000, 10**6])
def test_huge_attempts_cap(n):
    assert Backoff(base=0.1, factor=2, max_delay=30).delay(n) == 30
    assert Backoff(base=0.1, factor=1.5, max_delay=7, jitter=0.5, rng=random.Random(1)).delay(n) <= 7


def test_jitter_bounds():
    b = Backoff(base=1, factor=2, max_delay=100, jitter=0.25, rng=random.Random(3))
    for n in range(1, 12):
        full = min(100, 2 ** (n - 1))
        assert 0.75 * full <= b.delay(n) <= full


def test_retry_sleeps_between_attempts_only():
    slept, calls = [], []

    def flaky():
        calls.append(1)
        raise OSError("nope")

    with pytest.raises(RetryError) as err:
        retry(flaky, attempts=4, on=(OSError,), backoff=Backoff(base=1, factor=3, max_delay=100), sleep=slept.append)
    assert len(calls) == 4 and slept == [1, 3, 9]
    assert err.value.attempts == 4 and isinstance(err.value.last, OSError)


def test_retry_success_and_passthrough():
    slept, state = [], {"n": 0}

    def eventually():
        state["n"] += 1
        if state["n"] < 3:
            raise TimeoutError
        return "ok"

    assert retry(eventually, attempts=5, on=(TimeoutError,), sleep=slept.append) == "ok"
    assert slept == [0.1, 0.2]
    with pytest.raises(KeyError):
        retry(lambda: {}["x"], attempts=5, on=(OSError,), sleep=slept.append)
    assert len(slept) == 2
