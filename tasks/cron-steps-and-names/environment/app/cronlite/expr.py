"""CronExpr: the five parsed fields (minute hour day-of-month month day-of-week; Sunday = 0)."""
from dataclasses import dataclass

from .fields import parse_field

NAMES = ["minute", "hour", "day", "month", "weekday"]


@dataclass(frozen=True)
class CronExpr:
    minute: frozenset
    hour: frozenset
    day: frozenset
    month: frozenset
    weekday: frozenset
    day_star: bool = True
    weekday_star: bool = True

    def matches(self, dt):
        if dt.minute not in self.minute or dt.hour not in self.hour or dt.month not in self.month:
            return False
        dom = dt.day in self.day
        dow = (dt.isoweekday() % 7) in self.weekday
        if self.day_star or self.weekday_star:
            return dom and dow
        return dom or dow  # classic cron: both restricted -> either may match


def parse(text):
    parts = text.split()
    if len(parts) != 5:
        raise ValueError(f"expected 5 fields, got {len(parts)}")
    fields = {n: parse_field(p, n) for n, p in zip(NAMES, parts)}
    return CronExpr(**fields, day_star=parts[2] == "*", weekday_star=parts[4] == "*")
