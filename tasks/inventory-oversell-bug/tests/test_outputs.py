import pytest

from inventory import InsufficientStock, Inventory, Item, UnknownSku


@pytest.fixture
def inv():
    i = Inventory()
    i.add_item(Item("A", "a", 5))
    i.add_item(Item("B", "b", 0))
    return i


def test_remove_within_stock(inv):
    assert inv.remove("A", 2) == 3
    assert inv.remove("A", 3) == 0


def test_oversell_raises_and_keeps_stock(inv):
    with pytest.raises(InsufficientStock) as err:
        inv.remove("A", 6)
    assert (err.value.sku, err.value.requested, err.value.available) == ("A", 6, 5)
    assert inv.get("A").quantity == 5
    with pytest.raises(InsufficientStock):
        inv.remove("B", 1)


@pytest.mark.parametrize("qty", [0, -1, -10])
def test_non_positive_rejected(inv, qty):
    with pytest.raises(ValueError):
        inv.remove("A", qty)
    assert inv.get("A").quantity == 5


def test_unknown_sku(inv):
    with pytest.raises(UnknownSku):
        inv.remove("Z", 1)
