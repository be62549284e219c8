import json
import pathlib
import subprocess
import sys

from inventory import Inventory, Item
from inventory.storage import load, save

LEGACY = ("sku,name,quantity,reorder_level,unit_cost_cents\n"
          'Z-9,"Widget, large",4,2,1999\nA-1,Nut,100,0,3\n')


def sample():
    inv = Inventory()
    inv.add_item(Item("Q-2", 'Quote "q"', 7, 3, 45))
    inv.add_item(Item("B-1", "Bee", 0, 1, 0))
    return inv


def test_save_writes_json_v2(tmp_path):
    p = tmp_path / "inv.json"
    save(sample(), p)
    doc = json.loads(p.read_text())
    assert doc["format"] == 2
    assert doc["items"] == [
        {"sku": "B-1", "name": "Bee", "quantity": 0, "reorder_level": 1, "unit_cost_cents": 0},
        {"sku": "Q-2", "name": 'Quote "q"', "quantity": 7, "reorder_level": 3, "unit_cost_cents": 45},
    ]


def test_round_trip(tmp_path):
    p = tmp_path / "whatever.dat"
    save(sample(), p)
    inv = load(p)
    assert [(i.sku, i.name, i.quantity, i.reorder_level, i.unit_cost_cents) for i in inv.items()] == [
        ("B-1", "Bee", 0, 1, 0), ("Q-2", 'Quote "q"', 7, 3, 45)]


def test_legacy_csv_still_loads_regardless_of_extension(tmp_path):
    p = tmp_path / "old.json"
    p.write_text(LEGACY)
    inv = load(p)
    assert inv.get("Z-9").name == "Widget, large" and inv.get("A-1").quantity == 100


def test_migrate_cli(tmp_path):
    src, dst = tmp_path / "old.csv", tmp_path / "new.json"
    src.write_text(LEGACY)
    proc = subprocess.run([sys.executable, "-m", "inventory.migrate", str(src), str(dst)], cwd="/app",
                          capture_output=True, text=True, timeout=20)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(dst.read_text())
    assert doc["format"] == 2 and [i["sku"] for i in doc["items"]] == ["A-1", "Z-9"]


def test_repo_data_migrated():
    data = pathlib.Path("/app/data")
    assert not (data / "stock.csv").exists()
    doc = json.loads((data / "stock.json").read_text())
    assert doc["format"] == 2
    assert doc["items"][0] == {"sku": "A-100", "name": "Bolt, M6", "quantity": 250, "reorder_level": 100,
                               "unit_cost_cents": 12}
    assert [i["sku"] for i in doc["items"]] == ["A-100", "B-200", "C-300"]
