"""Money: an amount in a currency, stored as Decimal with the currency's minor-unit precision."""
from decimal import ROUND_HALF_UP, Decimal

MINOR_UNITS = {"USD": 2, "EUR": 2, "JPY": 0, "KWD": 3}


class Money:
    __slots__ = ("amount", "currency")

    def __init__(self, amount, currency="USD"):
        if currency not in MINOR_UNITS:
            raise ValueError(f"unknown currency {currency}")
        quantum = Decimal(1).scaleb(-MINOR_UNITS[currency])
        self.amount = Decimal(str(amount)).quantize(quantum, rounding=ROUND_HALF_UP)
        self.currency = currency

    def _check(self, other):
        if not isinstance(other, Money) or other.currency != self.currency:
            raise TypeError("can only combine Money of the same currency")

    def __add__(self, other):
        self._check(other)
        return Money(self.amount + other.amount, self.currency)

    def __sub__(self, other):
        self._check(other)
        return Money(self.amount - other.amount, self.currency)

    def __mul__(self, factor):
        return Money(self.amount * Decimal(str(factor)), self.currency)

    def __eq__(self, other):
        return isinstance(other, Money) and (self.amount, self.currency) == (other.amount, other.currency)

    def __hash__(self):
        return hash((self.amount, self.currency))

    def __repr__(self):
        return f"Money('{self.amount}', '{self.currency}')"

    def __str__(self):
        return f"{self.amount} {self.currency}"
