from semverlite import parse


def test_parse():
    v = parse("1.2.3-rc.1+build5")
    assert (v.major, v.minor, v.patch, v.prerelease, v.build) == (1, 2, 3, "rc.1", "build5")
