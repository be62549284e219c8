"""LRUCache: bounded mapping that evicts the least recently used entry."""
from collections import OrderedDict

_MISSING = object()


class LRUCache:
    def __init__(self, maxsize: int = 128):
        if maxsize < 1:
            raise ValueError("maxsize must be >= 1")
        self.maxsize = maxsize
        self._data = OrderedDict()  # least recently used first

    def get(self, key, default=None):
        value = self._data.get(key, _MISSING)
        if value is _MISSING:
            return default
        self._data.move_to_end(key)
        return value

    def put(self, key, value) -> None:
        if key in self._data:
            self._data[key] = value
            self._data.move_to_end(key)
            return
        if len(self._data) >= self.maxsize:
            self._data.popitem(last=False)
        self._data[key] = value

    def pop(self, key, default=None):
        return self._data.pop(key, default)

    def keys(self):
        """Keys from least to most recently used."""
        return list(self._data)

    def __contains__(self, key) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)
