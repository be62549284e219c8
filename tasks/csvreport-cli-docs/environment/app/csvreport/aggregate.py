"""Group-by aggregation."""
from collections import defaultdict

AGGREGATES = {
    "sum": sum,
    "count": len,
    "mean": lambda xs: sum(xs) / len(xs),
    "max": max,
    "min": min,
}


def summarise(rows, group_by, column, how="sum"):
    """Return [(group, value)] sorted by group; non-numeric cells are skipped."""
    groups = defaultdict(list)
    for row in rows:
        try:
            value = float(row[column])
        except (TypeError, ValueError):
            continue
        groups[row[group_by]].append(value)
    fn = AGGREGATES[how]
    return sorted((g, fn(vs)) for g, vs in groups.items())
