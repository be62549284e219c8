"""Backoff schedule: delay(n) for the n-th retry (n starts at 1)."""
import random


class Backoff:
    def __init__(self, base=0.1, factor=2.0, max_delay=30.0, jitter=0.0, rng=None):
        if base <= 0 or factor < 1 or max_delay <= 0 or not 0 <= jitter <= 1:
            raise ValueError("invalid backoff parameters")
        self.base, self.factor, self.max_delay, self.jitter = base, factor, max_delay, jitter
        self._rng = rng or random.Random()

    def delay(self, attempt):
        """base * factor**(attempt-1), capped at max_delay, then reduced by up to `jitter` fraction."""
        if attempt < 1:
            raise ValueError("attempt starts at 1")
        d = self.base * self.factor ** attempt
        d = min(self.max_delay, d)
        if self.jitter:
            d -= d * self.jitter * self._rng.random()
        return d
