import random
import subprocess
import sys

from logstats.parser import Entry
from logstats.stats import error_rate, top_paths

BENCH = r"""
import random, time
from logstats.parser import Entry
from logstats.stats import top_paths
rng = random.Random(0)
entries = [Entry(None, "GET", f"/p/{rng.randint(0, 40000)}", 200, 1) for _ in range(200000)]
t = time.perf_counter()
top_paths(entries, 10)
print(time.perf_counter() - t)
"""


def ref(entries, n):
    counts = {}
    for e in entries:
        counts[e.path] = counts.get(e.path, 0) + 1
    return sorted(counts.items(), key=lambda pc: (-pc[1], pc[0]))[:n]


def test_same_results():
    rng = random.Random(2)
    for _ in range(30):
        entries = [Entry(None, "GET", f"/{rng.choice('abcdefgh')}{rng.randint(0, 6)}", 200, 1)
                   for _ in range(rng.randint(0, 400))]
        for n in (0, 1, 3, 10, 1000):
            assert [tuple(x) for x in top_paths(entries, n)] == ref(entries, n)
    assert top_paths([], 5) == [] or list(top_paths([], 5)) == []


def test_default_n_and_ties():
    entries = [Entry(None, "GET", p, 200, 1) for p in ["/b", "/a", "/c", "/a", "/b", "/d"] + [f"/z{i}" for i in range(20)]]
    got = [tuple(x) for x in top_paths(entries)]
    assert got == ref(entries, 10)
    assert got[:3] == [("/a", 2), ("/b", 2), ("/c", 1)]


def test_error_rate_unchanged():
    entries = [Entry(None, "GET", "/", s, 1) for s in (200, 500, 503, 404)]
    assert error_rate(entries) == 0.5 and error_rate([]) == 0.0
    assert error_rate(iter(entries)) == 0.5


def test_scales():
    proc = subprocess.run([sys.executable, "-c", BENCH], cwd="/app", capture_output=True, text=True, timeout=15)
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout) < 1.5
