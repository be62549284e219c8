"""Range checks: comparators like '>=1.2.0 <2.0.0' (space = AND), ^ and ~ shorthands, '||' = OR."""
import re

from .version import Version, parse

_CMP = re.compile(r"(>=|<=|>|<|=)?\s*(\S+)")
_PARTIAL = re.compile(r"v?(0|[1-9]\d*)(?:\.(0|[1-9]\d*))?(?:\.(0|[1-9]\d*))?")


def _expand(part):
    """Yield (op, Version) comparators for one space-separated part."""
    if part[0] in "^~":
        text = part[1:]
        m = _PARTIAL.fullmatch(text)
        if m:
            given = [g for g in m.groups() if g is not None]
            major, minor, patch = (int(g) if g is not None else 0 for g in m.groups())
            low = Version(major, minor, patch)
        else:
            low = parse(text)
            major, minor, patch = low.major, low.minor, low.patch
            given = [1, 2, 3]
        if part[0] == "~":
            high = Version(major + 1, 0, 0) if len(given) == 1 else Version(major, minor + 1, 0)
        elif major > 0 or len(given) == 1:
            high = Version(major + 1, 0, 0)
        elif minor > 0 or len(given) == 2:
            high = Version(0, minor + 1, 0)
        else:
            high = Version(0, 0, patch + 1)
        yield ">=", low
        yield "<", high
        return
    m = _CMP.fullmatch(part)
    if not m:
        raise ValueError(f"bad comparator {part!r}")
    yield m[1] or "=", parse(m[2])


def _group_ok(v, group):
    for part in group.split():
        for op, target in _expand(part):
            ok = {">=": v >= target, "<=": v <= target, ">": v > target, "<": v < target, "=": v == target}[op]
            if not ok:
                return False
    return True


def satisfies(version, spec: str) -> bool:
    v = parse(version) if isinstance(version, str) else version
    return any(_group_ok(v, group) for group in spec.split("||"))
