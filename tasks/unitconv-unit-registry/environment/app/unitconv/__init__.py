"""unitconv: convert between units of length, mass and temperature."""
from .convert import convert
from .parse import parse_quantity

__all__ = ["convert", "parse_quantity"]
