"""Copy a workspace and diff it, run INSIDE the session's sandbox as the session's uid.

Grading must never walk agent-controlled paths as root in the server: a symlink swapped in during
the walk would make root read host files, and a FIFO would block the reading thread. So the
server runs this file (standard library only, passed to `python3 -I -c`) in the session's
sandbox, where the only host files visible are the read-only system directories and the mounts,
and it runs with the session's unprivileged uid, rlimits and a wall-clock budget. Even so it walks
by file descriptors (`openat` relative to the parent directory's descriptor with
`O_NOFOLLOW | O_NONBLOCK`, regular files only, checked with `fstat` after open), so the copy is a
consistent picture of what the agent could see, never of what a symlink pointed to.

    python3 -I -c SOURCE SRC DEST ORIG MAX_DIFF_BYTES [MODULE ...]

copies SRC into the existing directory DEST (symlinks as symlinks, special files skipped), then
writes the unified diff from ORIG (the task's initial workspace; "" for none) to DEST on stdout,
streamed file by file and capped at MAX_DIFF_BYTES, and one JSON line of facts on stderr:
`{"python", "version", "copied", "skipped", "entries_truncated", "missing"}` (`missing`: the
MODULEs, the task's declared test dependencies, that this python3 cannot import).
"""

from __future__ import annotations

import difflib
import importlib.util
import json
import os
import stat
import sys

MAX_FILE_BYTES = 2 * 2**20  # larger files are diffed as "large" (not read)
MAX_ENTRIES = 200_000  # files listed per tree for the diff
MAX_DEPTH = 128
DIFF_SKIP = {"__pycache__", ".pytest_cache", ".git"}
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK

counts = {"copied": 0, "skipped": 0, "entries_truncated": False}


def _copy_file(name: str, sfd: int, dfd: int) -> None:
    try:
        fd = os.open(name, _FILE, dir_fd=sfd)
    except OSError:
        counts["skipped"] += 1  # vanished, swapped for a symlink, unreadable
        return
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            counts["skipped"] += 1
            return
        out = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=dfd)
        try:
            while True:
                chunk = os.read(fd, 1 << 20)
                if not chunk:
                    break
                view = memoryview(chunk)
                while view:
                    view = view[os.write(out, view) :]
            os.fchmod(out, stat.S_IMODE(st.st_mode) | 0o600)
        finally:
            os.close(out)
        counts["copied"] += 1
    finally:
        os.close(fd)


def copy_dir(sfd: int, dfd: int, depth: int = 0) -> None:
    for name in sorted(os.listdir(sfd)):
        try:
            st = os.stat(name, dir_fd=sfd, follow_symlinks=False)
            if stat.S_ISLNK(st.st_mode):
                os.symlink(os.readlink(name, dir_fd=sfd), name, dir_fd=dfd)
                counts["copied"] += 1
            elif stat.S_ISDIR(st.st_mode) and depth < MAX_DEPTH:
                child = os.open(name, _DIR, dir_fd=sfd)
                try:
                    os.mkdir(name, 0o700, dir_fd=dfd)
                    new = os.open(name, _DIR, dir_fd=dfd)
                    try:
                        copy_dir(child, new, depth + 1)
                        os.fchmod(new, stat.S_IMODE(os.fstat(child).st_mode) | 0o700)
                    finally:
                        os.close(new)
                finally:
                    os.close(child)
            elif stat.S_ISREG(st.st_mode):
                _copy_file(name, sfd, dfd)
            else:
                counts["skipped"] += 1
        except OSError:
            counts["skipped"] += 1


def list_tree(fd: int, prefix: str = "", out: dict | None = None, depth: int = 0) -> dict:
    """{relative path: "file" | "symlink"} under the directory `fd` (skipping DIFF_SKIP)."""
    out = {} if out is None else out
    for name in sorted(os.listdir(fd)):
        if len(out) >= MAX_ENTRIES:
            counts["entries_truncated"] = True
            return out
        rel = prefix + name
        try:
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
        except OSError:
            continue
        if stat.S_ISLNK(st.st_mode):
            out[rel] = "symlink"
        elif stat.S_ISREG(st.st_mode):
            out[rel] = "file"
        elif stat.S_ISDIR(st.st_mode) and name not in DIFF_SKIP and depth < MAX_DEPTH:
            try:
                child = os.open(name, _DIR, dir_fd=fd)
            except OSError:
                continue
            try:
                list_tree(child, rel + "/", out, depth + 1)
            finally:
                os.close(child)
    return out


def read_entry(root_fd: int, rel: str, kind: str) -> bytes | None:
    """Contents of one listed entry, walking from `root_fd` by descriptors; None if it vanished."""
    *dirs, name = rel.split("/")
    fd = os.dup(root_fd)
    try:
        for d in dirs:
            nfd = os.open(d, _DIR, dir_fd=fd)
            os.close(fd)
            fd = nfd
        if kind == "symlink":
            return b"symlink -> " + os.fsencode(os.readlink(name, dir_fd=fd)) + b"\n"
        ffd = os.open(name, _FILE, dir_fd=fd)
        try:
            st = os.fstat(ffd)
            if not stat.S_ISREG(st.st_mode):
                return None
            if st.st_size > MAX_FILE_BYTES:
                return b"\x00large"
            chunks, size = [], 0
            while size <= MAX_FILE_BYTES:
                chunk = os.read(ffd, 1 << 20)
                if not chunk:
                    break
                chunks.append(chunk)
                size += len(chunk)
            data = b"".join(chunks)
            return data if len(data) <= MAX_FILE_BYTES else b"\x00large"
        finally:
            os.close(ffd)
    except OSError:
        return None
    finally:
        os.close(fd)


def diff(orig_fd: int | None, new_fd: int, max_bytes: int, write) -> None:
    old = list_tree(orig_fd) if orig_fd is not None else {}
    new = list_tree(new_fd)
    size = 0
    for rel in sorted(set(old) | set(new)):
        a = read_entry(orig_fd, rel, old[rel]) if orig_fd is not None and rel in old else None
        b = read_entry(new_fd, rel, new[rel]) if rel in new else None
        if a == b:
            continue
        if (a and b"\x00" in a[:8192]) or (b and b"\x00" in b[:8192]):
            chunk = [f"Binary files a/{rel} and b/{rel} differ\n"]
        else:
            chunk = list(
                difflib.unified_diff(
                    (a or b"").decode("utf-8", "replace").splitlines(keepends=True),
                    (b or b"").decode("utf-8", "replace").splitlines(keepends=True),
                    "/dev/null" if a is None else f"a/{rel}",
                    "/dev/null" if b is None else f"b/{rel}",
                )
            )
        for line in chunk:
            line = line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"
            size += len(line.encode("utf-8", "replace"))
            if size > max_bytes:
                write("... diff truncated ...\n")
                return
            write(line)


def main(argv: list[str]) -> int:
    src, dest, orig, max_bytes, modules = argv[0], argv[1], argv[2], int(argv[3]), argv[4:]
    sfd, dfd = os.open(src, _DIR), os.open(dest, _DIR)
    copy_dir(sfd, dfd)
    if max_bytes > 0:
        ofd = os.open(orig, _DIR) if orig else None
        out = open(sys.stdout.fileno(), "w", encoding="utf-8", errors="replace", closefd=False)
        diff(ofd, dfd, max_bytes, out.write)
        out.flush()
    missing = []
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(module)
    facts = {"python": sys.executable, "version": sys.version.split()[0], "missing": missing, **counts}
    sys.stderr.write(json.dumps(facts) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
