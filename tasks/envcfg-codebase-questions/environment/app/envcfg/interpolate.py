"""${NAME} and ${NAME:-default} interpolation; $$ is a literal dollar sign."""
import re

_REF = re.compile(r"\$\$|\$\{([A-Za-z_][A-Za-z0-9_.]*)(?::-([^}]*))?\}")
MAX_DEPTH = 10


class InterpolationError(ValueError):
    pass


def interpolate(value, lookup, _depth=0):
    """Replace references using lookup(name) -> str | None; referenced values are interpolated too."""
    if _depth > MAX_DEPTH:
        raise InterpolationError(f"reference cycle or too deep: {value!r}")

    def sub(m):
        if m.group(0) == "$$":
            return "$"
        name, default = m.group(1), m.group(2)
        found = lookup(name)
        if found is None:
            if default is None:
                raise InterpolationError(f"undefined: {name}")
            return interpolate(default, lookup, _depth + 1)
        return interpolate(found, lookup, _depth + 1)

    return _REF.sub(sub, value)
