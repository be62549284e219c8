"""Parse access-log lines: '2024-03-01T12:00:00+00:00 GET /path 200 123ms'."""
import datetime
import re
from dataclasses import dataclass

_LINE = re.compile(r"(\S+) (GET|POST|PUT|DELETE|PATCH) (\S+) (\d{3}) (\d+)ms")


@dataclass(frozen=True)
class Entry:
    time: datetime.datetime
    method: str
    path: str
    status: int
    latency_ms: int


def parse_line(line):
    m = _LINE.fullmatch(line.strip())
    if not m:
        return None
    when = datetime.datetime.fromisoformat(m[1])
    return Entry(when, m[2], m[3], int(m[4]), int(m[5]))


def parse_lines(lines):
    return [e for e in (parse_line(l) for l in lines) if e is not None]
