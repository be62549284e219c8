"""inventory: stock levels for a small warehouse."""
from .errors import InsufficientStock, UnknownSku
from .models import Item
from .store import Inventory

__all__ = ["Inventory", "Item", "InsufficientStock", "UnknownSku"]
