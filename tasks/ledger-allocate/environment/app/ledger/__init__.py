"""ledger: money amounts and invoices."""
from .money import Money

__all__ = ["Money"]
