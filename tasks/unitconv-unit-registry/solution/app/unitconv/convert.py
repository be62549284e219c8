"""convert(value, from_unit, to_unit)."""
from .units import lookup


def to_base(value, unit):
    u = lookup(unit)
    return value * u.scale + u.offset, u.dimension


def from_base(value, unit):
    u = lookup(unit)
    return (value - u.offset) / u.scale


def convert(value, from_unit, to_unit):
    base, dim = to_base(value, from_unit)
    dim_to = lookup(to_unit).dimension
    if dim != dim_to:
        raise ValueError(f"cannot convert {dim} to {dim_to}")
    return from_base(base, to_unit)
