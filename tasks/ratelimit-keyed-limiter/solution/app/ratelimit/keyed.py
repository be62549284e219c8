"""Per-key token buckets with LRU eviction of idle keys."""
from collections import OrderedDict

from .bucket import TokenBucket
from .clock import MonotonicClock


class KeyedLimiter:
    def __init__(self, rate: float, capacity: float, clock=None, max_keys: int = 1000):
        if max_keys < 1:
            raise ValueError("max_keys must be at least 1")
        self.rate = rate
        self.capacity = capacity
        self.max_keys = max_keys
        self._clock = clock or MonotonicClock()
        self._buckets: OrderedDict = OrderedDict()

    def _bucket(self, key) -> TokenBucket:
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = TokenBucket(self.rate, self.capacity, clock=self._clock)
            self._buckets[key] = bucket
            while len(self._buckets) > self.max_keys:
                self._buckets.popitem(last=False)
        else:
            self._buckets.move_to_end(key)
        return bucket

    def try_acquire(self, key, n: float = 1) -> bool:
        return self._bucket(key).try_acquire(n)

    def __len__(self) -> int:
        return len(self._buckets)
