"""parse_quantity('12.5 km') -> (12.5, 'km')."""
import re

from .convert import to_base

_Q = re.compile(r"\s*([-+]?\d+(?:\.\d+)?)\s*([A-Za-z]+)\s*")


def parse_quantity(text):
    m = _Q.fullmatch(text)
    if not m:
        raise ValueError(f"not a quantity: {text!r}")
    value, unit = float(m.group(1)), m.group(2)
    to_base(0.0, unit)  # validates the unit
    return value, unit
