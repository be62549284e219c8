import random
from decimal import Decimal

import pytest

from ledger import Money


def amounts(parts):
    return [str(p.amount) for p in parts]


def test_examples():
    assert amounts(Money("100").allocate([1, 1, 1])) == ["33.34", "33.33", "33.33"]
    assert amounts(Money("0.05").allocate([3, 7])) == ["0.02", "0.03"]
    assert amounts(Money("10").allocate([1, 0, 1])) == ["5.00", "0.00", "5.00"]
    assert amounts(Money("0.07").allocate([1, 2, 4])) == ["0.01", "0.02", "0.04"]
    assert amounts(Money("0.10").allocate([1, 1, 1, 3])) == ["0.02", "0.02", "0.01", "0.05"]
    assert amounts(Money("0.03").allocate(["0.5", "0.25", "0.25"])) == ["0.01", "0.01", "0.01"]
    assert amounts(Money("1000", "JPY").allocate([1, 2, 3])) == ["167", "333", "500"]
    assert amounts(Money("-100").allocate([1, 1, 1])) == ["-33.34", "-33.33", "-33.33"]
    assert amounts(Money("0.010", "KWD").allocate([1, 1, 1])) == ["0.004", "0.003", "0.003"]


def test_currency_and_types():
    parts = Money("7", "EUR").allocate([2, 5])
    assert all(isinstance(p, Money) and p.currency == "EUR" for p in parts)


@pytest.mark.parametrize("bad", [[], [0, 0], [1, -1], ["-0.5", 2]])
def test_invalid(bad):
    with pytest.raises(ValueError):
        Money("1").allocate(bad)


def test_property_sums_and_fairness():
    rng = random.Random(4)
    for _ in range(300):
        total = Money(Decimal(rng.randint(-100000, 100000)) / 100)
        ratios = [rng.randint(0, 9) for _ in range(rng.randint(1, 7))]
        if not any(ratios):
            continue
        parts = total.allocate(ratios)
        assert len(parts) == len(ratios)
        assert sum((p.amount for p in parts), Decimal(0)) == total.amount
        for p, r in zip(parts, ratios):
            exact = abs(total.amount) * r / sum(ratios)
            assert abs(abs(p.amount) - exact) < Decimal("0.01")
            if r == 0:
                assert p.amount == 0
