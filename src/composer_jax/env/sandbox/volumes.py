"""Size-limited directories for session workspaces and grading copies.

A session that fills its disk must not fill the host's. When the server may mount (root with
CAP_SYS_ADMIN, the usual case on a dedicated environment box), every workspace is its own tmpfs
with `size=` set from the task's `storage_mb`, so `dd if=/dev/zero` stops with ENOSPC inside that
session only. Otherwise the directory is plain and only the per-file size limit (RLIMIT_FSIZE)
applies; `volume_kind()` says which, and /health reports it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fcntl
import os
import re
import shutil
import stat
from pathlib import Path

_MNT_DETACH = 2
_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_can_mount: bool | None = None


def _mount_tmpfs(path: Path, size_mb: int, uid: int, gid: int) -> bool:
    # mount(2) through libc costs ~0.1 ms, spawning mount(8) ~3 ms: this is on the create path.
    options = f"size={int(size_mb)}m,mode=0755,uid={uid},gid={gid},nr_inodes=200000".encode()
    rc = _libc.mount(b"tmpfs", str(path).encode(), b"tmpfs", ctypes.c_ulong(0), ctypes.c_char_p(options))
    return rc == 0


def volume_kind() -> str:
    """'tmpfs' when per-session size-limited volumes work here, 'directory' otherwise."""
    global _can_mount
    if _can_mount is None:
        if os.geteuid() != 0:
            _can_mount = False
        else:
            import tempfile

            probe = Path(tempfile.mkdtemp(prefix="cj-volume-probe-"))
            try:
                _can_mount = _mount_tmpfs(probe, 1, 0, 0)
                if _can_mount:
                    _libc.umount2(str(probe).encode(), _MNT_DETACH)
            finally:
                probe.rmdir()
    return "tmpfs" if _can_mount else "directory"


def create_volume(path: Path, size_mb: int, uid: int | None = None, gid: int | None = None) -> None:
    """Create `path` as an empty directory of at most `size_mb` (when mounting is possible).

    `uid`/`gid` own the root so the sandboxed (unprivileged) user can write into it.
    """
    path.mkdir(parents=True, exist_ok=False)
    uid = os.geteuid() if uid is None else uid
    gid = os.getegid() if gid is None else gid
    if volume_kind() == "tmpfs" and _mount_tmpfs(path, size_mb, uid, gid):
        return
    if os.geteuid() == 0:
        os.chown(path, uid, gid)


def _unescape(field: str) -> str:
    # /proc/self/mountinfo escapes space, tab, newline and backslash as \ooo.
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def mounts_under(path: Path | str) -> list[str]:
    """Mount points at or below `path` in this process's mount namespace, deepest first."""
    base = os.path.abspath(path)
    found = []
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            for line in f:
                fields = line.split(" ")
                if len(fields) > 4:
                    point = _unescape(fields[4])
                    if point == base or point.startswith(base.rstrip("/") + "/"):
                        found.append(point)
    except OSError:
        return []
    return sorted(set(found), key=lambda p: (-p.count("/"), p))


def unmount_all(path: Path | str) -> None:
    """Detach every mount at or below `path` (deepest first)."""
    for _ in range(3):  # stacked mounts on one point need one umount each
        points = mounts_under(path)
        if not points:
            return
        for point in points:
            _libc.umount2(os.fsencode(point), _MNT_DETACH)


def remove_tree(path: Path) -> None:
    """Unmount everything at or below `path`, then delete it; never follows symlinks planted inside.

    Safe to call on a path that is gone, and twice."""
    unmount_all(path)
    if not os.path.lexists(path):
        return
    shutil.rmtree(path, ignore_errors=True)
    if os.path.lexists(path):  # e.g. a read-only directory left by the sandboxed user
        # By descriptors (fwalk, O_NOFOLLOW): a symlink planted in the tree is never followed.
        for _, dirs, _, dir_fd in os.fwalk(path, follow_symlinks=False):
            for d in dirs:
                try:
                    fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=dir_fd)
                except OSError:
                    continue
                try:
                    os.fchmod(fd, 0o755)
                except OSError:
                    pass
                finally:
                    os.close(fd)
        shutil.rmtree(path, ignore_errors=True)


LOCK_NAME = ".server-lock"


def hold_work_dir(work_dir: Path) -> int:
    """Mark `work_dir` as in use by this process (an flock the kernel drops if it dies); returns
    the descriptor to keep open. RuntimeError when another live server holds it."""
    fd = os.open(work_dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RuntimeError(
            f"work dir {str(work_dir)!r} is in use by another env-server; use another --work-dir"
        ) from None
    # The marker is written only once the lock is held, so a sweeper never takes a fresh directory
    # for a dead server's.
    Path(work_dir, LOCK_NAME).touch()
    return fd


def sweep_dead(parent: Path, prefix: str) -> list[str]:
    """Unmount and delete `parent/prefix*` directories left by servers that were killed (marker
    present, lock free); returns those removed. Directories of live servers are left alone."""
    removed: list[str] = []
    try:
        candidates = [p for p in Path(parent).iterdir() if p.name.startswith(prefix)]
    except OSError:
        return removed
    for d in candidates:
        if d.is_symlink() or not (d / LOCK_NAME).is_file():
            continue
        try:
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue  # a live server
        try:
            remove_tree(d)
            removed.append(str(d))
        finally:
            os.close(fd)
    return removed


def copy_tree(src: Path, dest: Path, uid: int | None = None, gid: int | None = None) -> None:
    """Copy the contents of `src` into the existing directory `dest`, owned by uid/gid.

    Symlinks are copied as symlinks (never followed), special files are skipped. Walks by name as
    the server's user: only for trusted sources (a task's `environment/app/` when a session is
    created). An agent's workspace is copied inside its sandbox, as its uid (`grader.prepare_job`).
    """
    owner = (uid, gid if gid is not None else uid) if os.geteuid() == 0 and uid is not None else None
    for root, dirs, files in os.walk(src, followlinks=False):
        rel = os.path.relpath(root, src)
        target_root = dest if rel == "." else dest / rel
        for name in dirs + files:
            s = os.path.join(root, name)
            t = target_root / name
            st = os.lstat(s)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(s), t)
            elif stat.S_ISDIR(st.st_mode):
                t.mkdir(mode=0o755)
            elif stat.S_ISREG(st.st_mode):
                shutil.copyfile(s, t, follow_symlinks=False)
                os.chmod(t, stat.S_IMODE(st.st_mode) | 0o600)
            else:
                continue
            if owner is not None:
                os.chown(t, *owner, follow_symlinks=False)
        # os.walk lists symlinked dirs in `dirs` but does not descend (followlinks=False): good.
