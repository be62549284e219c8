import datetime

from logstats.parser import parse_lines
from logstats.stats import in_window, requests_per_hour

LINES = [
    "2024-03-01T01:30:00+02:00 GET /a 200 5ms",   # 2024-02-29T23:30Z
    "2024-02-29T23:59:59Z GET /a 200 5ms",        # 23:59:59Z
    "2024-03-01T00:00:00 GET /b 500 5ms",         # naive = UTC
    "2024-02-29T19:15:00-05:00 GET /c 200 5ms",   # 2024-03-01T00:15Z
    "2024-03-01T05:45:00+05:45 GET /d 200 5ms",   # 2024-03-01T00:00Z
]


def test_times_are_aware_utc():
    entries = parse_lines(LINES)
    assert len(entries) == 5
    for e in entries:
        assert e.time.utcoffset() == datetime.timedelta(0)
    assert entries[0].time == datetime.datetime(2024, 2, 29, 23, 30, tzinfo=datetime.timezone.utc)


def test_hourly_buckets_in_utc():
    assert requests_per_hour(parse_lines(LINES)) == {"2024-02-29T23": 2, "2024-03-01T00": 3}


def test_window_with_offsets():
    entries = parse_lines(LINES)
    got = in_window(entries, "2024-03-01T00:00:00Z", "2024-03-01T00:15:00+00:00")
    assert sorted(e.path for e in got) == ["/b", "/d"]
    got = in_window(entries, "2024-03-01T01:00:00+01:00", "2024-03-01T00:15:01")
    assert sorted(e.path for e in got) == ["/b", "/c", "/d"]
    assert in_window(entries, "2024-02-29T18:00:00-05:00", "2024-02-29T23:30:00Z") == []
