"""Persistence: the inventory is saved as CSV (sku,name,quantity,reorder_level,unit_cost_cents)."""
import csv

from .models import Item
from .store import Inventory

FIELDS = ["sku", "name", "quantity", "reorder_level", "unit_cost_cents"]


def save(inv: Inventory, path) -> None:
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(FIELDS)
        for it in inv.items():
            w.writerow([it.sku, it.name, it.quantity, it.reorder_level, it.unit_cost_cents])


def load(path) -> Inventory:
    inv = Inventory()
    with open(path, newline="", encoding="utf-8") as fh:
        for row in csv.DictReader(fh):
            inv.add_item(Item(row["sku"], row["name"], int(row["quantity"]), int(row["reorder_level"]),
                              int(row["unit_cost_cents"])))
    return inv
