import pytest

from semverlite import satisfies

CASES = [
    ("^1.2.3", {"1.2.3": True, "1.9.9": True, "2.0.0": False, "1.2.2": False, "1.3.0": True}),
    ("^0.2.3", {"0.2.3": True, "0.2.9": True, "0.3.0": False, "0.2.2": False}),
    ("^0.0.3", {"0.0.3": True, "0.0.4": False, "0.0.2": False}),
    ("^1.2", {"1.2.0": True, "1.99.0": True, "2.0.0": False, "1.1.9": False}),
    ("^0.2", {"0.2.0": True, "0.2.7": True, "0.3.0": False}),
    ("^1", {"1.0.0": True, "1.5.5": True, "2.0.0": False, "0.9.9": False}),
    ("~1.2.3", {"1.2.3": True, "1.2.9": True, "1.3.0": False, "1.2.2": False}),
    ("~1.2", {"1.2.0": True, "1.2.9": True, "1.3.0": False}),
    ("~1", {"1.0.0": True, "1.9.0": True, "2.0.0": False}),
    ("~0.2.3", {"0.2.3": True, "0.3.0": False}),
    ("^1.2.3 <1.5.0", {"1.4.9": True, "1.5.0": False}),
    ("^1.0.0 || ^3.0.0", {"1.1.0": True, "2.0.0": False, "3.4.0": True, "4.0.0": False}),
    (">=2.0.0 <2.1.0 || =0.1.0", {"2.0.5": True, "0.1.0": True, "0.1.1": False}),
]


@pytest.mark.parametrize("spec,table", CASES, ids=[c[0] for c in CASES])
def test_ranges(spec, table):
    for version, want in table.items():
        assert satisfies(version, spec) is want, (version, spec)


def test_prerelease_bounds_and_old_syntax():
    assert satisfies("1.2.3-rc.1", "^1.2.2")
    assert satisfies("1.4.0", ">=1.2.0 <2.0.0") and not satisfies("2.0.0", ">=1.2.0 <2.0.0")
    assert satisfies("1.0.0", "1.0.0")
