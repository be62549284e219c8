from inventory import Inventory, Item


def test_receive():
    inv = Inventory()
    inv.add_item(Item("X", "x", 1))
    assert inv.receive("X", 2) == 3
