"""Clocks: callables returning seconds as float."""
import time


class MonotonicClock:
    def __call__(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock for tests: only moves when told to."""

    def __init__(self, start: float = 0.0):
        self.now = float(start)

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def __call__(self) -> float:
        return self.now
