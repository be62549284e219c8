"""Offline documentation index (web_search's default backend): prints figures, never passes or fails.

    python bench/doc_index.py [--packages DIST ...] [--docs-dir DIR]

Measures, in this interpreter's environment (default: every installed distribution, as
`composer-jax env-server --web-search offline` indexes by default):
  1. the first build (reading every distribution's .py files with `ast`) and the cache file's size;
  2. a restart: a new index object loading the same cache;
  3. query latency (median and max over a few natural-language queries).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from composer_jax.env.tools.doc_index import DocIndex

QUERIES = [
    "compare floating point numbers approximately",
    "parse command line arguments",
    "temporary directory that is removed afterwards",
    "read a JSON file",
    "matrix multiplication of two arrays",
    "retry an HTTP request with backoff",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--packages", nargs="+", help="distributions to index (default: all installed)")
    p.add_argument("--docs-dir", type=Path)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as cache:
        first = DocIndex(args.packages, args.docs_dir, Path(cache))
        t0 = time.perf_counter()
        first.ensure()
        build = time.perf_counter() - t0
        size = sum(f.stat().st_size for f in Path(cache).iterdir())
        print(f"distributions {len(first.dists)}, documents {len(first)}")
        print(f"first build {build:.1f} s, cache file {size / 2**20:.1f} MiB")
        again = DocIndex(args.packages, args.docs_dir, Path(cache))
        t0 = time.perf_counter()
        again.ensure()
        print(f"restart (cached) {time.perf_counter() - t0:.2f} s, from_cache={again.from_cache}")
        times = []
        for q in QUERIES:
            t0 = time.perf_counter()
            hits = again.search(q, 5)
            times.append(time.perf_counter() - t0)
            print(f"  {q!r}: {hits[0][1].url if hits else '-'}")
        print(f"query latency median {statistics.median(times) * 1e3:.1f} ms, max {max(times) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
