"""Reading processes from /proc, for the tests that kill servers and check what is left."""

from __future__ import annotations

from pathlib import Path


def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat after the command name: state, ppid, ... (FileNotFoundError when gone)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def gone(pid: int) -> bool:
    """No such process, or a zombie (dead, waiting for a parent that may not reap it)."""
    try:
        return _stat_fields(pid)[0] == "Z"
    except FileNotFoundError:
        return True


def children(pid: int) -> list[int]:
    """The processes whose parent is `pid`."""
    return [p for p, parent in _parents().items() if parent == pid]


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, their children, ...)."""
    parents = _parents()
    out, frontier = [], [pid]
    while frontier:
        kids = [p for p, pp in parents.items() if pp in frontier]
        out += kids
        frontier = kids
    return out


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _parents() -> dict[int, int]:
    parents: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parents[int(d.name)] = int(_stat_fields(int(d.name))[1])
            except (OSError, ValueError):
                continue
    return parents
