import random
import subprocess
import sys
from collections import OrderedDict

from lru import LRUCache

BENCH = r"""
import time
from lru import LRUCache
n = 100000
c = LRUCache(n)
t = time.perf_counter()
for i in range(n):
    c.put(i, i)
for i in range(n - 1, -1, -1):
    c.get(i)
for i in range(n, 2 * n):
    c.put(i, i)
for i in range(0, 2 * n, 7):
    c.pop(i)
print(time.perf_counter() - t)
"""


def test_large_cache_is_fast():
    proc = subprocess.run([sys.executable, "-c", BENCH], cwd="/app", capture_output=True, text=True, timeout=8)
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout) < 2.0


def test_behaviour_matches_reference():
    rng = random.Random(3)
    for size in (1, 3, 6):
        c, r = LRUCache(size), OrderedDict()
        for _ in range(4000):
            k = rng.randint(0, 10)
            op = rng.random()
            if op < 0.4:
                got = c.get(k, "-")
                want = r.get(k, "-")
                if k in r:
                    r.move_to_end(k)
                assert got == want
            elif op < 0.85:
                if k in r:
                    r.move_to_end(k)
                elif len(r) >= size:
                    r.popitem(last=False)
                r[k] = op
                c.put(k, op)
            else:
                assert c.pop(k, None) == r.pop(k, None)
            assert c.keys() == list(r) and len(c) == len(r)
            assert (k in c) == (k in r)


def test_maxsize_validation():
    import pytest
    with pytest.raises(ValueError):
        LRUCache(0)
