import datetime

import pytest

from cronlite import next_run, parse
from cronlite.fields import parse_field


@pytest.mark.parametrize("text,name,want", [
    ("*/15", "minute", {0, 15, 30, 45}),
    ("10-50/20", "minute", {10, 30, 50}),
    ("5/10", "minute", {5, 15, 25, 35, 45, 55}),
    ("*/5", "hour", {0, 5, 10, 15, 20}),
    ("1-31/10", "day", {1, 11, 21, 31}),
    ("jan,Mar,DEC", "month", {1, 3, 12}),
    ("feb-apr", "month", {2, 3, 4}),
    ("*/4", "month", {1, 5, 9}),
    ("mon-fri", "weekday", {1, 2, 3, 4, 5}),
    ("SAT,sun", "weekday", {0, 6}),
    ("7", "weekday", {0}),
    ("5-7", "weekday", {0, 5, 6}),
    ("1,2,3", "hour", {1, 2, 3}),
])
def test_fields(text, name, want):
    assert set(parse_field(text, name)) == want


@pytest.mark.parametrize("text,name", [("*/0", "minute"), ("*/-1", "minute"), ("60", "minute"), ("0-60/5", "minute"),
                                       ("8", "weekday"), ("foo", "month"), ("mon", "month"), ("jan", "weekday"),
                                       ("0", "day"), ("*/x", "hour")])
def test_invalid(text, name):
    with pytest.raises(ValueError):
        parse_field(text, name)


def test_next_run_with_new_syntax():
    start = datetime.datetime(2024, 3, 1, 17, 52)  # a Friday
    assert next_run("*/15 * * * *", start) == datetime.datetime(2024, 3, 1, 18, 0)
    assert next_run("30 9 * * mon-fri", start) == datetime.datetime(2024, 3, 4, 9, 30)
    assert next_run("0 0 1 */3 *", start) == datetime.datetime(2024, 4, 1, 0, 0)
    assert next_run("0 12 * * 7", start) == datetime.datetime(2024, 3, 3, 12, 0)
    assert parse("0 0 * * sun").weekday_star is False
