"""${NAME} and ${NAME:-default} interpolation; $$ is a literal dollar sign."""
import re

_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


class InterpolationError(ValueError):
    pass


def interpolate(value, lookup):
    """Replace references using lookup(name) -> str | None; referenced values are interpolated too."""

    def sub(m):
        name, default = m.group(1), m.group(2)
        found = lookup(name)
        if found is None:
            if default is None:
                raise InterpolationError(f"undefined: {name}")
            return default
        return interpolate(found, lookup)

    return _REF.sub(sub, value).replace("$$", "$")
