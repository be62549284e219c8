"""The unit table: base value = value * scale + offset (bases: m, kg, K)."""
from dataclasses import dataclass


@dataclass(frozen=True)
class Unit:
    dimension: str
    scale: float
    offset: float = 0.0


UNITS: dict[str, Unit] = {
    "m": Unit("length", 1.0),
    "km": Unit("length", 1000.0),
    "cm": Unit("length", 0.01),
    "mi": Unit("length", 1609.344),
    "ft": Unit("length", 0.3048),
    "kg": Unit("mass", 1.0),
    "g": Unit("mass", 0.001),
    "lb": Unit("mass", 0.45359237),
    "K": Unit("temperature", 1.0),
    "C": Unit("temperature", 1.0, 273.15),
    "F": Unit("temperature", 5.0 / 9.0, 273.15 - 32.0 * 5.0 / 9.0),
}


def register_unit(name, dimension, scale, offset=0.0):
    if name in UNITS:
        raise ValueError(f"unit {name!r} already registered")
    if scale == 0:
        raise ValueError("scale must be non-zero")
    UNITS[name] = Unit(dimension, float(scale), float(offset))


def lookup(name) -> Unit:
    try:
        return UNITS[name]
    except KeyError:
        raise ValueError(f"unknown unit {name!r}") from None
