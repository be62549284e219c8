"""convert(value, from_unit, to_unit)."""


def to_base(value, unit):
    if unit == "m":
        return value, "length"
    elif unit == "km":
        return value * 1000.0, "length"
    elif unit == "cm":
        return value * 0.01, "length"
    elif unit == "mi":
        return value * 1609.344, "length"
    elif unit == "ft":
        return value * 0.3048, "length"
    elif unit == "kg":
        return value, "mass"
    elif unit == "g":
        return value * 0.001, "mass"
    elif unit == "lb":
        return value * 0.45359237, "mass"
    elif unit == "K":
        return value, "temperature"
    elif unit == "C":
        return value + 273.15, "temperature"
    elif unit == "F":
        return (value - 32.0) * 5.0 / 9.0 + 273.15, "temperature"
    raise ValueError(f"unknown unit {unit!r}")


def from_base(value, unit):
    if unit == "m":
        return value
    elif unit == "km":
        return value / 1000.0
    elif unit == "cm":
        return value / 0.01
    elif unit == "mi":
        return value / 1609.344
    elif unit == "ft":
        return value / 0.3048
    elif unit == "kg":
        return value
    elif unit == "g":
        return value / 0.001
    elif unit == "lb":
        return value / 0.45359237
    elif unit == "K":
        return value
    elif unit == "C":
        return value - 273.15
    elif unit == "F":
        return (value - 273.15) * 9.0 / 5.0 + 32.0
    raise ValueError(f"unknown unit {unit!r}")


def convert(value, from_unit, to_unit):
    base, dim = to_base(value, from_unit)
    _, dim_to = to_base(0.0, to_unit)
    if dim != dim_to:
        raise ValueError(f"cannot convert {dim} to {dim_to}")
    return from_base(base, to_unit)
