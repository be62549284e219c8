"""Single cron fields: '*', '5', '1-5', '1,15,30'."""

BOUNDS = {"minute": (0, 59), "hour": (0, 23), "day": (1, 31), "month": (1, 12), "weekday": (0, 6)}


def parse_field(text, name):
    lo, hi = BOUNDS[name]
    values = set()
    for part in text.split(","):
        if part == "*":
            values.update(range(lo, hi + 1))
            continue
        if "-" in part:
            a, b = part.split("-", 1)
            start, end = int(a), int(b)
        else:
            start = end = int(part)
        if not (lo <= start <= end <= hi):
            raise ValueError(f"{name}: {part!r} out of range {lo}-{hi}")
        values.update(range(start, end + 1))
    return frozenset(values)
