"""Reorder report: what to buy to bring low items back up."""
import sys

from .store import Inventory


def reorder_report(inv: Inventory, target_multiple: int = 2) -> list[dict]:
    rows = []
    for it in inv.items():
        if it.reorder_level <= 0 or it.quantity > it.reorder_level:
            continue
        qty = target_multiple * it.reorder_level - it.quantity
        rows.append({"sku": it.sku, "name": it.name, "on_hand": it.quantity, "reorder_qty": qty,
                     "cost_cents": qty * it.unit_cost_cents})
    rows.sort(key=lambda r: (-r["cost_cents"], r["sku"]))
    return rows


def main(argv=None) -> int:
    from .storage import load

    argv = sys.argv[1:] if argv is None else argv
    for row in reorder_report(load(argv[0])):
        print(f"{row['sku']},{row['reorder_qty']},{row['cost_cents']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
