"""${NAME} and ${NAME:-default} interpolation; $$ is a literal dollar sign.

Defaults may themselves contain references (``${PORT:-${DEFAULT_PORT}}``); names may contain dots
(``${db.host}``). Substituted values are interpolated recursively, up to MAX_DEPTH levels.
"""
import re

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*")
MAX_DEPTH = 10


class InterpolationError(ValueError):
    pass


def _closing_brace(value, start):
    """Index of the '}' matching the '{' at value[start], or -1."""
    depth = 0
    for j in range(start, len(value)):
        if value[j] == "{":
            depth += 1
        elif value[j] == "}":
            depth -= 1
            if depth == 0:
                return j
    return -1


def interpolate(value, lookup, _depth=0):
    """Replace references using lookup(name) -> str | None; referenced values are interpolated too."""
    if _depth > MAX_DEPTH:
        raise InterpolationError(f"reference cycle or nesting deeper than {MAX_DEPTH}: {value!r}")
    out, i, n = [], 0, len(value)
    while i < n:
        if value.startswith("$$", i):
            out.append("$")
            i += 2
            continue
        if value.startswith("${", i):
            end = _closing_brace(value, i + 1)
            if end < 0:  # unterminated: keep literally
                out.append(value[i:])
                break
            name, sep, default = value[i + 2:end].partition(":-")
            if not _NAME.fullmatch(name):
                raise InterpolationError(f"bad reference name {name!r}")
            found = lookup(name)
            if found is None:
                if not sep:
                    raise InterpolationError(f"undefined: {name}")
                out.append(interpolate(default, lookup, _depth + 1))
            else:
                out.append(interpolate(found, lookup, _depth + 1))
            i = end + 1
            continue
        out.append(value[i])
        i += 1
    return "".join(out)
