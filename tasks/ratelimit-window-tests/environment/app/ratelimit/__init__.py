"""ratelimit: in-process rate limiting primitives."""
from .bucket import TokenBucket
from .clock import ManualClock, MonotonicClock
from .errors import RateLimited
from .window import SlidingWindowLog

__all__ = ["TokenBucket", "SlidingWindowLog", "RateLimited", "ManualClock", "MonotonicClock"]
