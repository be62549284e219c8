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


def requests_per_hour(entries):
    """{'YYYY-MM-DDTHH': count} keyed by the hour in UTC."""
    out = {}
    for e in entries:
        key = e.time.strftime("%Y-%m-%dT%H")
        out[key] = out.get(key, 0) + 1
    return dict(sorted(out.items()))


def in_window(entries, start, end):
    """Entries with start <= time < end (start/end are ISO-8601 strings, UTC unless they carry an offset)."""
    from .parser import to_utc

    s, t = to_utc(start), to_utc(end)
    return [e for e in entries if s <= e.time < t]
