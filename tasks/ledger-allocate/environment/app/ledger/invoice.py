"""Invoices: lines of (description, unit price, quantity) plus a tax rate."""
from .money import Money


class Invoice:
    def __init__(self, currency="USD", tax_rate="0"):
        self.currency = currency
        self.tax_rate = tax_rate
        self.lines = []

    def add(self, description, unit_price, quantity=1):
        self.lines.append((description, Money(unit_price, self.currency), quantity))

    def subtotal(self):
        total = Money(0, self.currency)
        for _, price, qty in self.lines:
            total = total + price * qty
        return total

    def tax(self):
        return self.subtotal() * self.tax_rate

    def total(self):
        return self.subtotal() + self.tax()
