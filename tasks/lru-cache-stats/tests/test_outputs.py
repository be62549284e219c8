from lru import LRUCache, memoize


def test_stats_counting():
    c = LRUCache(2)
    assert c.stats() == {"hits": 0, "misses": 0, "evictions": 0, "size": 0, "maxsize": 2}
    c.put("a", 1); c.put("b", 2)
    c.get("a"); c.get("a"); c.get("x"); c.get("y", 5)
    c.put("c", 3)          # evicts b
    c.put("a", 9)          # update, no eviction
    c.pop("c")             # not an eviction
    c.pop("nope")
    assert c.stats() == {"hits": 2, "misses": 2, "evictions": 1, "size": 1, "maxsize": 2}


def test_clear_stats_keeps_data():
    c = LRUCache(1)
    c.put(1, 1); c.put(2, 2); c.get(2); c.get(1)
    c.clear_stats()
    assert c.stats() == {"hits": 0, "misses": 0, "evictions": 0, "size": 1, "maxsize": 1}
    assert c.get(2) == 2


def test_contains_is_not_a_lookup():
    c = LRUCache(2)
    c.put(1, 1)
    assert 1 in c and 2 not in c
    assert c.stats()["hits"] == 0 and c.stats()["misses"] == 0


def test_memoize_cache_info():
    calls = []

    @memoize(maxsize=2)
    def sq(x):
        calls.append(x)
        return x * x

    for x in [1, 2, 1, 3, 2, 2]:
        sq(x)
    info = sq.cache_info()
    assert info["misses"] == len(calls) == 4
    assert info["hits"] == 2
    assert info["evictions"] == 2
    assert info["size"] == 2 and info["maxsize"] == 2
    assert sq(3) == 9
