"""cronlite: parse 5-field cron expressions and compute next run times."""
from .expr import CronExpr, parse
from .schedule import next_run

__all__ = ["CronExpr", "parse", "next_run"]
