"""Token bucket: `rate` tokens per second, at most `capacity` stored; starts full."""
from .clock import MonotonicClock
from .errors import RateLimited


class TokenBucket:
    def __init__(self, rate: float, capacity: float, clock=None):
        if rate <= 0 or capacity <= 0:
            raise ValueError("rate and capacity must be positive")
        self.rate = float(rate)
        self.capacity = float(capacity)
        self._clock = clock or MonotonicClock()
        self._tokens = self.capacity
        self._last = self._clock()

    def _refill(self) -> None:
        now = self._clock()
        elapsed = now - self._last
        self._tokens = min(self.capacity, self._tokens + elapsed * self.rate)
        self._last = now

    @property
    def available(self) -> float:
        self._refill()
        return self._tokens

    def try_acquire(self, n: float = 1) -> bool:
        self._refill()
        if self._tokens >= n:
            self._tokens -= n
            return True
        return False

    def acquire(self, n: float = 1) -> None:
        if n > self.capacity:
            raise ValueError("request larger than bucket capacity")
        if not self.try_acquire(n):
            raise RateLimited((n - self._tokens) / self.rate)
