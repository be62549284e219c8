"""lru: a small least-recently-used cache and a memoising decorator."""
from .core import LRUCache
from .decorators import memoize

__all__ = ["LRUCache", "memoize"]
