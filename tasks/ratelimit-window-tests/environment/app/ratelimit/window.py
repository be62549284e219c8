"""Sliding-window log: at most `limit` hits per key in any `window` seconds."""
from collections import defaultdict, deque

from .clock import MonotonicClock


class SlidingWindowLog:
    def __init__(self, limit: int, window: float, clock=None):
        self.limit = limit
        self.window = float(window)
        self._clock = clock or MonotonicClock()
        self._hits = defaultdict(deque)

    def hit(self, key) -> bool:
        """Record a hit for key and return True, or return False (recording nothing) if over the limit."""
        now = self._clock()
        log = self._hits[key]
        while log and log[0] <= now - self.window:
            log.popleft()
        if len(log) < self.limit:
            log.append(now)
            return True
        return False

    def count(self, key) -> int:
        now = self._clock()
        return sum(1 for t in self._hits.get(key, ()) if t > now - self.window)
