from decimal import Decimal

import pytest

from ledger import Money
from ledger.invoice import Invoice


@pytest.mark.parametrize("raw,cur,want", [
    ("1.005", "USD", "1.01"), ("2.675", "EUR", "2.68"), ("0.125", "USD", "0.13"), ("-1.005", "USD", "-1.01"),
    ("1234.5", "JPY", "1235"), ("0.0005", "KWD", "0.001"), (1.005, "USD", "1.01"), (Decimal("9.995"), "USD", "10.00"),
    ("12345678901234567.89", "USD", "12345678901234567.89")])
def test_construction_rounds_half_up(raw, cur, want):
    m = Money(raw, cur)
    assert m.amount == Decimal(want) and str(m.amount) == want


def test_multiplication_exact():
    assert Money("0.10") * 3 == Money("0.30")
    assert Money("19.99") * "0.15" == Money("3.00")
    assert Money("1.15") * "0.5" == Money("0.58")
    assert Money("100", "JPY") * "1.125" == Money("113", "JPY")


def test_invoice():
    inv = Invoice(tax_rate="0.15")
    inv.add("widget", "0.10", 3)
    inv.add("gizmo", "1.005")
    assert inv.subtotal() == Money("1.31")
    assert inv.tax() == Money("0.20")
    assert inv.total() == Money("1.51")


def test_no_float_in_source():
    src = open("/app/ledger/money.py").read()
    assert "float(" not in src
