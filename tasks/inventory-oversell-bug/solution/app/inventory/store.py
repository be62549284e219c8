"""The Inventory: a collection of Items keyed by SKU."""
from .errors import InsufficientStock, UnknownSku
from .models import Item


class Inventory:
    def __init__(self):
        self._items: dict[str, Item] = {}

    def add_item(self, item: Item) -> None:
        if item.sku in self._items:
            raise ValueError(f"duplicate sku {item.sku}")
        self._items[item.sku] = item

    def get(self, sku: str) -> Item:
        try:
            return self._items[sku]
        except KeyError:
            raise UnknownSku(sku) from None

    def receive(self, sku: str, qty: int) -> int:
        if qty <= 0:
            raise ValueError("qty must be positive")
        item = self.get(sku)
        item.quantity += qty
        return item.quantity

    def remove(self, sku: str, qty: int) -> int:
        if qty <= 0:
            raise ValueError("qty must be positive")
        item = self.get(sku)
        if qty > item.quantity:
            raise InsufficientStock(sku, qty, item.quantity)
        item.quantity -= qty
        return item.quantity

    def items(self) -> list[Item]:
        return sorted(self._items.values(), key=lambda i: i.sku)

    def total_value_cents(self) -> int:
        return sum(i.value_cents for i in self._items.values())
