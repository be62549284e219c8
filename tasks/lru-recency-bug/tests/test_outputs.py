import random
from collections import OrderedDict

from lru import LRUCache, memoize


class Ref:
    def __init__(self, n):
        self.n, self.d = n, OrderedDict()

    def get(self, k, default=None):
        if k not in self.d:
            return default
        self.d.move_to_end(k)
        return self.d[k]

    def put(self, k, v):
        if k in self.d:
            self.d.move_to_end(k)
        elif len(self.d) >= self.n:
            self.d.popitem(last=False)
        self.d[k] = v


def test_get_refreshes():
    c = LRUCache(2)
    c.put("a", 1); c.put("b", 2)
    c.get("a")
    c.put("c", 3)
    assert "a" in c and "b" not in c and "c" in c


def test_update_refreshes():
    c = LRUCache(2)
    c.put("a", 1); c.put("b", 2)
    c.put("a", 10)
    c.put("c", 3)
    assert c.get("a") == 10 and "b" not in c
    assert c.keys() == ["c", "a"]


def test_miss_does_not_change_order():
    c = LRUCache(2)
    c.put(1, 1); c.put(2, 2)
    assert c.get(3) is None
    assert c.keys() == [1, 2]


def test_random_ops_match_reference():
    rng = random.Random(7)
    for size in (1, 2, 5):
        c, r = LRUCache(size), Ref(size)
        for _ in range(3000):
            k = rng.randint(0, 8)
            if rng.random() < 0.5:
                assert c.get(k, -1) == r.get(k, -1)
            else:
                c.put(k, k * 3)
                r.put(k, k * 3)
            assert c.keys() == list(r.d)


def test_memoize_keeps_hot_key():
    calls = []

    @memoize(maxsize=2)
    def f(x):
        calls.append(x)
        return x * x

    f(1); f(2); f(1); f(3); f(1)
    assert calls == [1, 2, 3]
