"""Aggregations over parsed entries."""


def top_paths(entries, n=10):
    """The n most requested paths as (path, count), by count descending then path ascending."""
    paths = [e.path for e in entries]
    unique = []
    for p in paths:
        if p not in unique:
            unique.append(p)
    counted = [(p, paths.count(p)) for p in unique]
    counted.sort(key=lambda pc: (-pc[1], pc[0]))
    return counted[:n]


def error_rate(entries):
    if not entries:
        return 0.0
    return sum(1 for e in entries if e.status >= 500) / len(entries)


def latency_percentiles(entries, ps=(50, 95, 99), path=None):
    """Nearest-rank latency percentiles in ms: {p: value}."""
    import math

    values = sorted(e.latency_ms for e in entries if path is None or e.path == path)
    if not values:
        raise ValueError("no matching entries")
    out = {}
    for p in ps:
        if not 0 < p <= 100:
            raise ValueError(f"percentile out of range: {p}")
        out[p] = values[max(math.ceil(p / 100 * len(values)), 1) - 1]
    return out
