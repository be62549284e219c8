"""unitconv: convert between units of length, mass and temperature."""
from .convert import convert
from .parse import parse_quantity
from .units import UNITS, register_unit

__all__ = ["convert", "parse_quantity", "register_unit", "UNITS"]
