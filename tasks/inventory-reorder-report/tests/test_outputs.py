import subprocess
import sys

from inventory import Inventory, Item
from inventory.reports import reorder_report


def build():
    inv = Inventory()
    inv.add_item(Item("A", "Alpha", 3, 10, 100))   # 17 * 100 = 1700
    inv.add_item(Item("B", "Beta", 10, 10, 5))     # at level: 10 * 5 = 50
    inv.add_item(Item("C", "Gamma", 11, 10, 999))  # above level
    inv.add_item(Item("D", "Delta", 0, 0, 7))      # no reorder level
    inv.add_item(Item("E", "Eps", 0, 5, 340))      # 10 * 340 = 3400
    inv.add_item(Item("F", "Phi", 1, 1, 1700))     # 1 * 1700 = 1700
    return inv


def test_report_rows_and_order():
    rows = reorder_report(build())
    assert [r["sku"] for r in rows] == ["E", "A", "F", "B"]
    assert rows[0] == {"sku": "E", "name": "Eps", "on_hand": 0, "reorder_qty": 10, "cost_cents": 3400}
    assert rows[1]["reorder_qty"] == 17 and rows[1]["cost_cents"] == 1700


def test_target_multiple():
    rows = {r["sku"]: r for r in reorder_report(build(), target_multiple=3)}
    assert rows["A"]["reorder_qty"] == 27 and rows["B"]["reorder_qty"] == 20 and rows["F"]["reorder_qty"] == 2


def test_empty():
    assert reorder_report(Inventory()) == []


def test_cli(tmp_path):
    csv = tmp_path / "s.csv"
    csv.write_text("sku,name,quantity,reorder_level,unit_cost_cents\n"
                   'A-1,"Bolt, M6",250,100,12\nB-2,Hinge,8,10,340\nC-3,Bracket,0,5,560\nD-4,Nut,0,0,1\n')
    out = subprocess.run([sys.executable, "-m", "inventory.reports", str(csv)], cwd="/app",
                         capture_output=True, text=True, timeout=20)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["C-3,10,5600", "B-2,12,4080"]
