"""Per-session control groups: a memory and process-count budget for the whole session.

rlimits are per process (RLIMIT_AS) or per uid (RLIMIT_NPROC); a cgroup bounds the session as a
whole, including tmpfs pages it writes, and lets close() find every process it ever started.
Used only when the server runs as root and the cgroup hierarchy is writable (v1 with `memory` and
`pids` controllers, or v2 with both enabled); otherwise `detect()` returns None and rlimits alone
apply. /health reports which.
"""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

ROOT = Path("/sys/fs/cgroup")
GROUP = "composer-jax-env"
_SAFE = re.compile(r"[^A-Za-z0-9_.-]")


class SessionCgroup:
    """The cgroup directories of one session (one per controller on v1, one on v2)."""

    def __init__(self, dirs: list[Path]):
        self.dirs = dirs

    def enter_prefix(self) -> list[str]:
        """argv prefix that moves the process into this cgroup, then execs the rest of argv."""
        writes = " && ".join(f"echo $$ > {d}/cgroup.procs" for d in self.dirs)
        return ["/bin/sh", "-c", f'{writes} && exec "$@"', "sh"]

    def pids(self) -> list[int]:
        found: set[int] = set()
        for d in self.dirs:
            try:
                found.update(int(x) for x in (d / "cgroup.procs").read_text().split())
            except OSError:
                pass
        return sorted(found)

    def kill(self) -> None:
        """SIGKILL every process in the group, until it is empty (at most ~1 s)."""
        for _ in range(50):
            pids = self.pids()
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.02)

    def kill_and_remove(self) -> None:
        self.kill()
        for d in self.dirs:
            try:
                d.rmdir()
            except OSError:
                pass


class CgroupLimiter:
    """Creates per-session cgroups under one parent group; `kind` is 'v1' or 'v2'."""

    def __init__(self, kind: str, parents: dict[str, Path]):
        self.kind, self.parents = kind, parents

    @classmethod
    def detect(cls) -> CgroupLimiter | None:
        if os.geteuid() != 0:
            return None
        try:
            if (ROOT / "cgroup.controllers").is_file():
                controllers = (ROOT / "cgroup.controllers").read_text().split()
                if not {"memory", "pids"} <= set(controllers):
                    return None
                parent = ROOT / GROUP
                parent.mkdir(exist_ok=True)
                (ROOT / "cgroup.subtree_control").write_text("+memory +pids")
                (parent / "cgroup.subtree_control").write_text("+memory +pids")
                return cls("v2", {"unified": parent})
            parents = {}
            for controller in ("memory", "pids"):
                base = ROOT / controller
                if not base.is_dir():
                    return None
                parent = base / GROUP
                parent.mkdir(exist_ok=True)
                parents[controller] = parent
            probe = cls("v1", parents)
            probe.create("probe", None).kill_and_remove()
            return probe
        except OSError:
            return None

    def create(self, session_id: str, limits) -> SessionCgroup:
        name = _SAFE.sub("_", session_id)
        dirs = []
        for controller, parent in self.parents.items():
            d = parent / name
            if d.exists():
                SessionCgroup([d]).kill_and_remove()
            d.mkdir()
            dirs.append(d)
            if limits is None:
                continue
            memory = str(limits.memory_mb * 2**20)
            if self.kind == "v2":
                (d / "memory.max").write_text(memory)
                if (d / "memory.swap.max").exists():
                    (d / "memory.swap.max").write_text("0")
                (d / "pids.max").write_text(str(limits.processes))
            elif controller == "memory":
                (d / "memory.limit_in_bytes").write_text(memory)
            else:
                (d / "pids.max").write_text(str(limits.processes))
        return SessionCgroup(dirs)

    def cleanup(self) -> None:
        """Remove leftover session groups (from a server that was killed)."""
        for parent in self.parents.values():
            for child in parent.iterdir() if parent.is_dir() else []:
                if child.is_dir():
                    SessionCgroup([child]).kill_and_remove()
