import random

from semverlite import parse, satisfies

SPEC_ORDER = ["1.0.0-alpha", "1.0.0-alpha.1", "1.0.0-alpha.beta", "1.0.0-beta", "1.0.0-beta.2",
              "1.0.0-beta.11", "1.0.0-rc.1", "1.0.0", "1.0.1-0", "1.0.1-1a", "1.0.1", "1.10.0", "2.0.0-a.b.c.d",
              "2.0.0-a.b.c.d.e", "2.0.0"]


def test_semver_spec_order():
    shuffled = SPEC_ORDER[:]
    random.Random(5).shuffle(shuffled)
    assert [str(v) for v in sorted(parse(s) for s in shuffled)] == SPEC_ORDER


def test_pairwise():
    vs = [parse(s) for s in SPEC_ORDER]
    for i, a in enumerate(vs):
        for j, b in enumerate(vs):
            assert (a < b) == (i < j) and (a == b) == (i == j), (a, b)


def test_build_metadata_ignored():
    assert parse("1.2.3+a") == parse("1.2.3+b") == parse("1.2.3")
    assert hash(parse("1.2.3+a")) == hash(parse("1.2.3"))
    assert len({parse("1.0.0-rc.1+x"), parse("1.0.0-rc.1")}) == 1
    assert str(parse("1.2.3+exp.sha")) == "1.2.3+exp.sha"


def test_ranges_with_prereleases():
    assert satisfies("1.0.0", ">1.0.0-rc.1")
    assert not satisfies("1.0.0-rc.1", ">=1.0.0")
    assert satisfies("1.0.0-beta.11", ">1.0.0-beta.2 <1.0.0")
