import itertools

import pytest

from unitconv import convert, parse_quantity

POINTS = [  # (K, C, F)
    (273.15, 0.0, 32.0), (373.15, 100.0, 212.0), (233.15, -40.0, -40.0), (0.0, -273.15, -459.67),
    (310.15, 37.0, 98.6),
]


@pytest.mark.parametrize("k,c,f", POINTS)
def test_all_pairs(k, c, f):
    vals = {"K": k, "C": c, "F": f}
    for a, b in itertools.permutations(vals, 2):
        assert convert(vals[a], a, b) == pytest.approx(vals[b], abs=1e-9), (a, b)


def test_round_trip_and_other_dims():
    for x in (-50.0, 0.0, 12.34, 1000.0):
        assert convert(convert(x, "F", "C"), "C", "F") == pytest.approx(x)
    assert convert(1, "mi", "km") == pytest.approx(1.609344)
    assert convert(2, "lb", "g") == pytest.approx(907.18474)
    with pytest.raises(ValueError):
        convert(1, "kg", "C")


@pytest.mark.parametrize("text,want", [("-40 C", (-40.0, "C")), ("+3.5km", (3.5, "km")), (" -0.5 F ", (-0.5, "F")),
                                       ("12 lb", (12.0, "lb"))])
def test_parse(text, want):
    assert parse_quantity(text) == want


@pytest.mark.parametrize("bad", ["--4 C", "C", "4 parsecs", "4.C"])
def test_parse_rejects(bad):
    with pytest.raises(ValueError):
        parse_quantity(bad)
