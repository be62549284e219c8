"""python3 -m logstats FILE: print a summary."""
import sys

from .parser import parse_lines
from .stats import error_rate, top_paths


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    with open(argv[0], encoding="utf-8") as fh:
        entries = parse_lines(fh)
    print(f"requests {len(entries)}")
    print(f"errors {error_rate(entries):.2%}")
    for path, count in top_paths(entries, 5):
        print(f"{count:>6} {path}")
    return 0
