from logstats.parser import parse_line


def test_parse():
    e = parse_line("2024-03-01T12:00:00+00:00 GET /a 200 12ms")
    assert e.path == "/a" and e.status == 200 and e.latency_ms == 12
