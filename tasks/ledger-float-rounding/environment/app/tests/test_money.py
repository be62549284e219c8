from ledger import Money


def test_add():
    assert Money("1.10") + Money("2.20") == Money("3.30")
