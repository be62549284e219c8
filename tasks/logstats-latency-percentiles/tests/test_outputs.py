import math
import random
import subprocess
import sys

import pytest

from logstats.parser import parse_lines
from logstats.stats import latency_percentiles


def make(latencies, path="/a"):
    return parse_lines(f"2024-03-01T12:00:{i % 60:02d}+00:00 GET {path} 200 {ms}ms" for i, ms in enumerate(latencies))


def nearest(values, p):
    s = sorted(values)
    return s[max(math.ceil(p / 100 * len(s)), 1) - 1]


def test_known_values():
    e = make(range(1, 101))
    assert latency_percentiles(e) == {50: 50, 95: 95, 99: 99}
    assert latency_percentiles(make([15, 20, 35, 40, 50]), ps=(5, 30, 40, 50, 100)) == {
        5: 15, 30: 20, 40: 20, 50: 35, 100: 50}


def test_random_against_reference():
    rng = random.Random(11)
    for _ in range(50):
        vals = [rng.randint(1, 5000) for _ in range(rng.randint(1, 300))]
        ps = (1, 33.3, 50, 90, 99.9, 100)
        assert latency_percentiles(make(vals), ps=ps) == {p: nearest(vals, p) for p in ps}


def test_path_filter_and_errors():
    e = make([1, 2, 3], "/a") + make([100, 200], "/b")
    assert latency_percentiles(e, ps=(50,), path="/b") == {50: 100}
    with pytest.raises(ValueError):
        latency_percentiles(e, path="/zzz")
    with pytest.raises(ValueError):
        latency_percentiles([])
    for bad in (0, -1, 100.5):
        with pytest.raises(ValueError):
            latency_percentiles(e, ps=(bad,))


def test_cli(tmp_path):
    log = tmp_path / "a.log"
    log.write_text("".join(f"2024-03-01T12:00:00+00:00 GET /x 200 {ms}ms\n" for ms in range(10, 210, 10))
                   + "garbage line\n")
    out = subprocess.run([sys.executable, "-m", "logstats", str(log)], cwd="/app", capture_output=True, text=True,
                         timeout=20)
    lines = out.stdout.splitlines()
    assert lines[:5] == ["requests 20", "errors 0.00%", "p50 100ms", "p95 190ms", "p99 200ms"]
    empty = tmp_path / "e.log"
    empty.write_text("")
    out = subprocess.run([sys.executable, "-m", "logstats", str(empty)], cwd="/app", capture_output=True, text=True,
                         timeout=20)
    assert out.returncode == 0 and out.stdout.splitlines() == ["requests 0", "errors 0.00%"]
