"""kvstore: a tiny append-only key-value file store with a CLI."""
from .store import Store

__version__ = "1.3.0"
__all__ = ["Store"]
