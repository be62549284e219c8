import datetime

from cronlite import next_run


def test_hourly():
    assert next_run("0 * * * *", datetime.datetime(2024, 1, 1, 10, 30)) == datetime.datetime(2024, 1, 1, 11, 0)
