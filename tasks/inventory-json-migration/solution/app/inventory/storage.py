"""Persistence: JSON ({"format": 2, "items": [...]}); legacy CSV files are still readable."""
import csv
import io
import json

from .models import Item
from .store import Inventory

FIELDS = ["sku", "name", "quantity", "reorder_level", "unit_cost_cents"]
FORMAT = 2


def save(inv: Inventory, path) -> None:
    doc = {"format": FORMAT, "items": [{f: getattr(it, f) for f in FIELDS} for it in inv.items()]}
    with open(path, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2)
        fh.write("\n")


def _from_rows(rows) -> Inventory:
    inv = Inventory()
    for row in rows:
        inv.add_item(Item(str(row["sku"]), str(row["name"]), int(row["quantity"]), int(row["reorder_level"]),
                          int(row["unit_cost_cents"])))
    return inv


def load(path) -> Inventory:
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    if text.lstrip().startswith("{"):
        doc = json.loads(text)
        if doc.get("format") != FORMAT:
            raise ValueError(f"unsupported inventory format {doc.get('format')!r}")
        return _from_rows(doc["items"])
    return _from_rows(csv.DictReader(io.StringIO(text, newline="")))
