"""next_run(expr, after): the first matching minute strictly after `after`."""
import datetime

from .expr import parse


def next_run(expr, after):
    if isinstance(expr, str):
        expr = parse(expr)
    t = after.replace(second=0, microsecond=0) + datetime.timedelta(minutes=1)
    for _ in range(60 * 24 * 366 * 5):
        if expr.matches(t):
            return t
        t += datetime.timedelta(minutes=1)
    raise ValueError("no run time within 5 years")
