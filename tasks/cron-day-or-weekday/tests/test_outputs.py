import datetime

from cronlite import next_run, parse

D = datetime.datetime


def runs(expr, start, n):
    out, t = [], start
    for _ in range(n):
        t = next_run(expr, t)
        out.append(t)
    return out


def test_weekday_numbering():
    assert next_run("0 9 * * 1", D(2024, 3, 1, 12, 0)) == D(2024, 3, 4, 9, 0)   # Mon
    assert next_run("0 9 * * 0", D(2024, 3, 1, 12, 0)) == D(2024, 3, 3, 9, 0)   # Sun
    assert next_run("0 9 * * 6", D(2024, 3, 1, 12, 0)) == D(2024, 3, 2, 9, 0)   # Sat


def test_dom_or_dow():
    got = runs("0 0 1,15 * 5", D(2024, 2, 28), 5)
    assert got == [D(2024, 3, 1), D(2024, 3, 8), D(2024, 3, 15), D(2024, 3, 22), D(2024, 3, 29)]
    got = runs("30 6 13 * 5", D(2024, 9, 1), 4)
    assert got == [D(2024, 9, 6, 6, 30), D(2024, 9, 13, 6, 30), D(2024, 9, 20, 6, 30), D(2024, 9, 27, 6, 30)]


def test_star_means_and():
    assert runs("0 0 13 * *", D(2024, 1, 1), 2) == [D(2024, 1, 13), D(2024, 2, 13)]
    assert runs("0 0 * * 2", D(2024, 1, 1), 2) == [D(2024, 1, 2), D(2024, 1, 9)]


def test_matches():
    e = parse("0 0 1 * 1")
    assert e.matches(D(2024, 4, 1)) and e.matches(D(2024, 4, 8)) and not e.matches(D(2024, 4, 9))
