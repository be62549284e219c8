import pytest

from semverlite import parse, satisfies


def test_parse_fields():
    v = parse("1.2.3-rc.1+b7")
    assert (v.major, v.minor, v.patch, v.prerelease, v.build) == (1, 2, 3, "rc.1", "b7")


@pytest.mark.parametrize("bad", ["1.2", "01.2.3", "1.02.3", "1.2.03", "a.b.c", "1.2.3-"])
def test_invalid(bad):
    with pytest.raises(ValueError):
        parse(bad)


def test_precedence():
    order = ["1.0.0-alpha", "1.0.0-alpha.1", "1.0.0-alpha.beta", "1.0.0-beta", "1.0.0-beta.2",
             "1.0.0-beta.11", "1.0.0-rc.1", "1.0.0", "2.0.0"]
    vs = [parse(s) for s in order]
    assert sorted(reversed(vs)) == vs
    for a, b in zip(vs, vs[1:]):
        assert a < b and not b < a


def test_build_ignored():
    assert parse("1.0.0+a") == parse("1.0.0+b")
    assert hash(parse("1.0.0+a")) == hash(parse("1.0.0"))
    assert not parse("1.0.0+a") < parse("1.0.0+b")


def test_satisfies():
    assert satisfies("1.4.0", ">=1.2.0 <2.0.0")
    assert not satisfies("2.0.0", ">=1.2.0 <2.0.0")
    assert not satisfies("1.1.0", ">=1.2.0 <2.0.0")
    assert not satisfies("1.2.0", ">1.2.0")
    assert satisfies("1.2.1", ">1.2.0")
    assert satisfies("1.2.0", "<=1.2.0") and not satisfies("1.2.1", "<=1.2.0")
    assert satisfies("1.2.0", "=1.2.0") and satisfies("1.2.0", "1.2.0")
