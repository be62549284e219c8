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

    def allocate(self, ratios):
        """Split into parts proportional to ratios that sum exactly to self (largest remainder method)."""
        ratios = [Decimal(str(r)) for r in ratios]
        if not ratios or any(r < 0 for r in ratios) or sum(ratios) == 0:
            raise ValueError("ratios must be non-negative and not all zero")
        exp = MINOR_UNITS[self.currency]
        units = int(abs(self.amount).scaleb(exp))
        total = sum(ratios)
        exact = [Decimal(units) * r / total for r in ratios]
        parts = [int(x) for x in exact]
        leftover = units - sum(parts)
        order = sorted(range(len(ratios)), key=lambda i: (-(exact[i] - parts[i]), i))
        for i in order[:leftover]:
            parts[i] += 1
        sign = -1 if self.amount < 0 else 1
        return [Money(Decimal(sign * p).scaleb(-exp), self.currency) for p in parts]
