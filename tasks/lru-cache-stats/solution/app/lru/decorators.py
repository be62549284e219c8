"""memoize: cache a function's results in an LRUCache keyed by its arguments."""
import functools

from .core import LRUCache

_MISSING = object()


def memoize(maxsize: int = 128):
    def decorate(fn):
        cache = LRUCache(maxsize)

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            key = (args, tuple(sorted(kwargs.items())))
            value = cache.get(key, _MISSING)
            if value is _MISSING:
                value = fn(*args, **kwargs)
                cache.put(key, value)
            return value

        wrapper.cache = cache
        wrapper.cache_info = cache.stats
        return wrapper

    return decorate
