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
writes the git-style diff (`diff`: a patch `git apply` applies) from ORIG (the task's initial
workspace; "" for none) to DEST on stdout, streamed file by file and capped at MAX_DIFF_BYTES,
and one JSON line of facts on stderr:
`{"python", "version", "copied", "skipped", "entries_truncated", "missing"}` (`missing`: the
MODULEs, the task's declared test dependencies, that this python3 cannot import).
"""

from __future__ import annotations

import base64
import difflib
import hashlib
import importlib.util
import json
import os
import stat
import sys
import zlib

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


TRUNCATED = "... diff truncated ...\n"  # the last line of a diff cut at its byte budget (not a patch line)
_B85_CHUNK = 52  # bytes of compressed data per line of a git binary patch


def _blob_id(data: bytes | None) -> str:
    """git's object id of a blob (40 zeros for an absent file): a binary patch's index line."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest() if data is not None else "0" * 40


def _binary_patch(rel: str, a: bytes | None, b: bytes | None) -> list[str]:
    """A git binary patch (forward "literal" hunk only, which `git apply` accepts) replacing a by b."""
    body = zlib.compress(b or b"")
    lines = [f"index {_blob_id(a)}..{_blob_id(b)}\n", "GIT binary patch\n", f"literal {len(b or b'')}\n"]
    for i in range(0, len(body), _B85_CHUNK):
        chunk = body[i : i + _B85_CHUNK]
        n = len(chunk)
        head = chr(ord("A") + n - 1) if n <= 26 else chr(ord("a") + n - 27)
        lines.append(head + base64.b85encode(chunk, pad=True).decode("ascii") + "\n")
    return lines + ["\n"]


def _text_lines(data: bytes) -> list[str]:
    """UTF-8 text split at \\n only (as git and patch do: str.splitlines would also split at \\r,
    form feeds and Unicode separators, and the hunks would not apply)."""
    parts = data.decode("utf-8").split("\n")
    lines = [x + "\n" for x in parts[:-1]]
    return lines + [parts[-1]] if parts[-1] else lines


def _is_text(data: bytes | None) -> bool:
    if data is None:
        return True
    if b"\x00" in data:
        return False
    try:
        data.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def file_patch(rel: str, a: bytes | None, b: bytes | None, kinds: tuple[str | None, str | None]) -> list[str]:
    """One file's section of a git-style diff that `git apply` applies: a `diff --git` header (new /
    deleted file mode), then unified hunks for UTF-8 text or a git binary patch for other contents.
    Symlinks and files over MAX_FILE_BYTES (not read) get git's "Binary files ... differ" line,
    which names them but does not apply (whoever submits the diff leaves such a section out)."""
    head = [f"diff --git a/{rel} b/{rel}\n"]
    if a is None:
        head.append("new file mode 100644\n")
    elif b is None:
        head.append("deleted file mode 100644\n")
    if "symlink" in kinds or a == b"\x00large" or b == b"\x00large":
        return head + [f"Binary files a/{rel} and b/{rel} differ\n"]
    if not (_is_text(a) and _is_text(b)):
        return head + _binary_patch(rel, a, b)
    old, new = _text_lines(a or b""), _text_lines(b or b"")
    if not old and not new:  # an empty file created or deleted: the header says it all
        return head + [f"index {_blob_id(a)[:7]}..{_blob_id(b)[:7]}\n"]
    hunks = difflib.unified_diff(
        old, new, "/dev/null" if a is None else f"a/{rel}", "/dev/null" if b is None else f"b/{rel}"
    )
    return head + [x if x.endswith("\n") else x + "\n\\ No newline at end of file\n" for x in hunks]


def diff(orig_fd: int | None, new_fd: int, max_bytes: int, write) -> None:
    """The diff from the tree `orig_fd` (None: empty) to `new_fd`, file by file (`file_patch`), to
    `write`; past `max_bytes` it stops with the TRUNCATED line (the diff is then not a patch)."""
    old = list_tree(orig_fd) if orig_fd is not None else {}
    new = list_tree(new_fd)
    size = 0
    for rel in sorted(set(old) | set(new)):
        a = read_entry(orig_fd, rel, old[rel]) if orig_fd is not None and rel in old else None
        b = read_entry(new_fd, rel, new[rel]) if rel in new else None
        if a == b:
            continue
        for line in file_patch(rel, a, b, (old.get(rel), new.get(rel))):
            size += len(line.encode("utf-8", "replace"))
            if size > max_bytes:
                write(TRUNCATED)
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
