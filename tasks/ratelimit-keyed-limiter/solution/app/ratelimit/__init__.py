"""ratelimit: in-process rate limiting primitives."""
from .bucket import TokenBucket
from .clock import ManualClock, MonotonicClock
from .errors import RateLimited
from .keyed import KeyedLimiter
from .window import SlidingWindowLog

__all__ = ["TokenBucket", "KeyedLimiter", "SlidingWindowLog", "RateLimited", "ManualClock", "MonotonicClock"]
