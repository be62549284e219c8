"""Aggregations over parsed entries."""
import heapq
from collections import Counter


def top_paths(entries, n=10):
    """The n most requested paths as (path, count), by count descending then path ascending."""
    counts = Counter(e.path for e in entries)
    return heapq.nsmallest(n, counts.items(), key=lambda pc: (-pc[1], pc[0]))


def error_rate(entries):
    total = errors = 0
    for e in entries:
        total += 1
        errors += e.status >= 500
    return errors / total if total else 0.0
