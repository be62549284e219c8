import ast
import itertools
import pathlib

import pytest

import unitconv
from unitconv import convert, parse_quantity

ORIG = {"m": ("length", 1.0, 0), "km": ("length", 1000.0, 0), "cm": ("length", 0.01, 0),
        "mi": ("length", 1609.344, 0), "ft": ("length", 0.3048, 0), "kg": ("mass", 1.0, 0),
        "g": ("mass", 0.001, 0), "lb": ("mass", 0.45359237, 0), "K": ("temperature", 1.0, 0),
        "C": ("temperature", 1.0, 273.15), "F": ("temperature", 5 / 9, 273.15 - 32 * 5 / 9)}


def ref(value, a, b):
    da, sa, oa = ORIG[a]
    db, sb, ob = ORIG[b]
    return ((value * sa + oa) - ob) / sb


def test_behaviour_preserved():
    for a, b in itertools.permutations(ORIG, 2):
        if ORIG[a][0] != ORIG[b][0]:
            with pytest.raises(ValueError):
                convert(1.0, a, b)
            continue
        for v in (-40.0, 0.0, 1.0, 123.456):
            assert convert(v, a, b) == pytest.approx(ref(v, a, b), rel=1e-9, abs=1e-9), (v, a, b)


def test_table_and_no_chains():
    from unitconv.units import UNITS
    assert set(ORIG) <= set(UNITS)
    for name, (dim, scale, offset) in ORIG.items():
        u = UNITS[name]
        assert u.dimension == dim and u.scale == pytest.approx(scale) and u.offset == pytest.approx(offset)
    for mod in ("convert.py", "parse.py"):
        tree = ast.parse(pathlib.Path("/app/unitconv", mod).read_text())
        consts = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        hardcoded = sorted(consts & set(ORIG))
        assert not hardcoded, f"{mod} still hardcodes units {hardcoded}"


def test_register_unit():
    unitconv.register_unit("yd", "length", 0.9144)
    unitconv.register_unit("R", "temperature", 5 / 9)
    assert convert(1, "yd", "ft") == pytest.approx(3.0)
    assert convert(491.67, "R", "C") == pytest.approx(0.0, abs=1e-9)
    assert parse_quantity("2 yd") == (2.0, "yd")
    with pytest.raises(ValueError):
        unitconv.register_unit("km", "length", 1000.0)
    with pytest.raises(ValueError):
        convert(1, "yd", "kg")


def test_unknown_unit():
    with pytest.raises(ValueError):
        convert(1, "furlong", "m")
    with pytest.raises(ValueError):
        parse_quantity("3 furlong")
