"""LRUCache: bounded mapping that evicts the least recently used entry."""

_MISSING = object()


class LRUCache:
    def __init__(self, maxsize: int = 128):
        if maxsize < 1:
            raise ValueError("maxsize must be >= 1")
        self.maxsize = maxsize
        self._data = {}
        self._order = []  # least recently used first

    def _touch(self, key):
        self._order.remove(key)
        self._order.append(key)

    def get(self, key, default=None):
        value = self._data.get(key, _MISSING)
        if value is _MISSING:
            return default
        return value

    def put(self, key, value) -> None:
        if key in self._data:
            self._data[key] = value
            return
        if len(self._data) >= self.maxsize:
            oldest = self._order.pop(0)
            del self._data[oldest]
        self._data[key] = value
        self._order.append(key)

    def pop(self, key, default=None):
        if key not in self._data:
            return default
        self._order.remove(key)
        return self._data.pop(key)

    def keys(self):
        """Keys from least to most recently used."""
        return list(self._order)

    def __contains__(self, key) -> bool:
        return key in self._data

    def __len__(self) -> int:
        return len(self._data)
