"""Semantic versions (https://semver.org): MAJOR.MINOR.PATCH[-PRERELEASE][+BUILD]."""
import functools
import re

_RE = re.compile(r"(0|[1-9]\d*)\.(0|[1-9]\d*)\.(0|[1-9]\d*)(?:-([0-9A-Za-z.-]+))?(?:\+([0-9A-Za-z.-]+))?")


def _prerelease_key(pre):
    # A version without prerelease ranks above any prerelease of the same core.
    if not pre:
        return (1,)
    parts = []
    for ident in pre.split("."):
        if ident.isdigit():
            parts.append((0, int(ident), ""))
        else:
            parts.append((1, 0, ident))
    return (0, tuple(parts))


@functools.total_ordering
class Version:
    def __init__(self, major, minor, patch, prerelease="", build=""):
        self.major, self.minor, self.patch = major, minor, patch
        self.prerelease, self.build = prerelease, build

    def _key(self):
        return (self.major, self.minor, self.patch, _prerelease_key(self.prerelease))

    def __eq__(self, other):
        return isinstance(other, Version) and self._key() == other._key()

    def __lt__(self, other):
        return self._key() < other._key()

    def __hash__(self):
        return hash(self._key())

    def __str__(self):
        s = f"{self.major}.{self.minor}.{self.patch}"
        if self.prerelease:
            s += "-" + self.prerelease
        if self.build:
            s += "+" + self.build
        return s

    def __repr__(self):
        return f"Version({str(self)!r})"


def parse(text: str) -> Version:
    m = _RE.fullmatch(text.strip().lstrip("v"))
    if not m:
        raise ValueError(f"invalid version: {text!r}")
    return Version(int(m[1]), int(m[2]), int(m[3]), m[4] or "", m[5] or "")
