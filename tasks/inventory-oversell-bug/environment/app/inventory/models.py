from dataclasses import dataclass


@dataclass
class Item:
    sku: str
    name: str
    quantity: int = 0
    reorder_level: int = 0
    unit_cost_cents: int = 0

    @property
    def value_cents(self) -> int:
        return self.quantity * self.unit_cost_cents
