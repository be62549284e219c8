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


def to_utc(text):
    """Parse an ISO-8601 timestamp ('Z' allowed) into an aware UTC datetime; naive means UTC."""
    if text.endswith(("Z", "z")):
        text = text[:-1] + "+00:00"
    when = datetime.datetime.fromisoformat(text)
    if when.tzinfo is None:
        return when.replace(tzinfo=datetime.timezone.utc)
    return when.astimezone(datetime.timezone.utc)


def parse_line(line):
    m = _LINE.fullmatch(line.strip())
    if not m:
        return None
    when = to_utc(m[1])
    return Entry(when, m[2], m[3], int(m[4]), int(m[5]))


def parse_lines(lines):
    return [e for e in (parse_line(l) for l in lines) if e is not None]
