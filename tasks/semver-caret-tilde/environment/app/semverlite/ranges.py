"""Range checks: comparators like '>=1.2.0 <2.0.0' (space = AND)."""
import re

from .version import parse

_CMP = re.compile(r"(>=|<=|>|<|=)?\s*(\S+)")


def satisfies(version, spec: str) -> bool:
    v = parse(version) if isinstance(version, str) else version
    for part in spec.split():
        m = _CMP.fullmatch(part)
        if not m:
            raise ValueError(f"bad comparator {part!r}")
        op, target = m[1] or "=", parse(m[2])
        ok = {">=": v >= target, "<=": v <= target, ">": v > target, "<": v < target, "=": v == target}[op]
        if not ok:
            return False
    return True
