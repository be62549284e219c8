class InventoryError(Exception):
    pass


class UnknownSku(InventoryError, KeyError):
    pass


class InsufficientStock(InventoryError):
    def __init__(self, sku, requested, available):
        super().__init__(f"{sku}: requested {requested}, only {available} in stock")
        self.sku, self.requested, self.available = sku, requested, available
