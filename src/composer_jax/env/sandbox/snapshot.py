"""Copy a workspace, or carry an agent's change onto the task's pristine workspace; run INSIDE
the session's sandbox as the session's uid.

Grading must never walk agent-controlled paths as root in the server: a symlink swapped in during
the walk would make root read host files, and a FIFO would block the reading thread. So the
server runs this file (standard library only, passed to `python3 -I -c`) in the session's
sandbox, where the only host files visible are the read-only system directories and the mounts,
and it runs with the session's unprivileged uid, rlimits and a wall-clock budget. Even so it walks
by file descriptors (`openat` relative to the parent directory's descriptor with
`O_NOFOLLOW | O_NONBLOCK`, regular files only, checked with `fstat` after open).

    python3 -I -c SOURCE SRC DEST ORIG MAX_DIFF_BYTES [POLICY LEVERS_SOURCE] [MODULE ...]

Without ORIG (""), copies SRC into the existing directory DEST (symlinks as symlinks, special
files skipped): the oracle's and the miner's copies of trusted trees.

With ORIG (the task's pristine workspace) it **grades the patch, not the workspace**: DEST becomes
a copy of ORIG, and the agent's change (SRC against ORIG) is carried onto it file by file, only
what a text patch can say: new, changed and deleted regular UTF-8 text files. What is not carried
is named by class in `excluded` (`carry`): symlinks, bytecode and native code (`.pyc`, `.so`, ...),
other binary files, files over MAX_FILE_BYTES, anything under `.git` / `.hg` / `.svn` or a cache
folder, startup hooks (`sitecustomize` / `usercustomize`, `*.pth`), `conftest.py` files and pytest's
configuration (a whole `pytest.ini`, the pytest part of `tox.ini` / `setup.cfg` / `pyproject.toml`,
read the way pytest reads them), the test files the task grades (POLICY `test_files`), and for a
verifier this project did not write, a new module at a sys.path root named like the runner or a
standard-library module (POLICY `shadow_rule`). POLICY `code_under_test` (task.toml) names the
test-infrastructure files that are the task's subject, which are carried. Every carried Python
file is read by the lever scanner (`levers.py`, whose source is LEVERS_SOURCE) against its pristine
version; what it finds is `levers`.

It writes the git-style diff of what was carried (`git apply` applies it) on stdout, capped at
MAX_DIFF_BYTES (the grade is of the whole change, the diff is the record), and one JSON line of
facts on stderr: `{"python", "version", "copied", "skipped", "entries_truncated", "missing",
"carried", "excluded": [{"path", "class"}], "levers": [{"path", "line", "lever", "what", "code"}],
"carried_sha256"}` (`carried_sha256`: a hash of every deletion and write carried, path, mode and
bytes: two carries of equal hashes made equal trees from ORIG)
(`missing`: the MODULEs, the task's declared test dependencies, that this python3 cannot import).
"""

from __future__ import annotations

import base64
import configparser
import difflib
import fnmatch
import hashlib
import importlib.util
import json
import os
import stat
import sys
import types
import zlib

MAX_FILE_BYTES = 2 * 2**20  # larger files are diffed as "large" (not read)
MAX_ENTRIES = 200_000  # files listed per tree for the diff
MAX_DEPTH = 128
MAX_EXCLUDED = 200  # entries of `excluded` listed; the rest counted in one line
VCS = {".git", ".hg", ".svn"}
CACHES = {"__pycache__", ".pytest_cache", ".mypy_cache", ".ruff_cache", ".hypothesis"}
DIFF_SKIP = VCS | CACHES
BYTECODE = (".pyc", ".pyo", ".so", ".pyd", ".dylib", ".dll")
STARTUP = {"sitecustomize", "usercustomize"}
CONFIGS = ("pytest.ini", ".pytest.ini", "pytest.toml", ".pytest.toml", "tox.ini", "setup.cfg", "pyproject.toml")
WHOLE_CONFIGS = ("pytest.ini", ".pytest.ini", "pytest.toml", ".pytest.toml")  # pytest reads all of these
# For a verifier this project did not write (a plain `python -m pytest` from /app): names a new
# module at a sys.path root must not take, as they would stand in for the runner.
RUNNER = {
    "pytest", "_pytest", "py", "pluggy", "unittest", "iniconfig", "packaging", "pygments", "exceptiongroup",
    "tomli", "colorama", "run_tests", "attr", "more_itertools", "atomicwrites", "six", "wcwidth", "toml",
    "importlib_metadata", "zipp",
}  # fmt: skip
ROOTS = ("", "src")
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW
_FILE = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK

counts = {"copied": 0, "skipped": 0, "entries_truncated": False}
skipped_dirs: list = []  # (relative path) of VCS and cache folders list_tree passed over


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


def copy_dir(sfd: int, dfd: int, depth: int = 0, skip: frozenset = frozenset()) -> None:
    for name in sorted(os.listdir(sfd)):
        if name in skip:
            continue
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
                        copy_dir(child, new, depth + 1, skip)
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


def list_tree(fd: int, prefix: str = "", out: dict | None = None, depth: int = 0, seen: list | None = None) -> dict:
    """{relative path: "file" | "symlink"} under the directory `fd` (skipping DIFF_SKIP, whose
    paths go to `seen`)."""
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
        elif stat.S_ISDIR(st.st_mode) and name in DIFF_SKIP:
            if seen is not None:
                seen.append(rel)
        elif stat.S_ISDIR(st.st_mode) and depth < MAX_DEPTH:
            try:
                child = os.open(name, _DIR, dir_fd=fd)
            except OSError:
                continue
            try:
                list_tree(child, rel + "/", out, depth + 1, seen)
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


def pytest_part(name: str, data: bytes) -> str:
    """What pytest reads of a configuration file ("" when nothing): the whole text of pytest.ini and
    the like, the pytest sections of the others. An INI file is read twice, split at LF only (as
    configparser does) and at every line boundary `str.splitlines` knows (as pytest's iniconfig does:
    CR, form feed, ...); the two views joined, so a section hidden from one is seen by the other."""
    text = data.decode("utf-8", "replace")
    if name in WHOLE_CONFIGS:
        return text or " "
    if name == "pyproject.toml":
        try:
            import tomllib

            part = tomllib.loads(text).get("tool", {}).get("pytest")
        except Exception:  # noqa: BLE001 - no tomllib (Python < 3.11) or not TOML: compare it all
            return text
        return json.dumps(part, sort_keys=True, default=str) if part is not None else ""
    views = []
    for view in (text, "\n".join(text.splitlines())):
        parser = configparser.RawConfigParser(strict=False)
        try:
            parser.read_string(view)
        except configparser.Error:
            return text
        sections = {s: dict(parser[s]) for s in ("pytest", "tool:pytest") if parser.has_section(s)}
        views.append(json.dumps(sections, sort_keys=True) if sections else "")
    return "" if not any(views) else "\n".join(views)


def _top_module(rel: str) -> str | None:
    """The top-level module name `rel` makes importable from a sys.path root (ROOTS), if any."""
    parts = rel.split("/")
    if parts[0] == "src" and len(parts) > 1:
        parts = parts[1:]
    name = parts[0]
    if len(parts) > 1:
        return name if name.isidentifier() else None
    stem, _, suffix = name.partition(".")
    return stem if "." + suffix.split(".")[-1] in (".py", ".pyc", ".so", ".pyd") and stem.isidentifier() else None


class Carrier:
    """Decides, for each path the agent changed, whether the change is carried (`classify`)."""

    def __init__(self, policy: dict, orig_listing: dict, levers=None):
        self.code_under_test = list(policy.get("code_under_test", []))
        self.test_files = set(policy.get("test_files", []))
        self.shadow_rule = bool(policy.get("shadow_rule", False))
        self.orig = orig_listing
        self.levers = levers
        tops = {_top_module(rel) for rel in orig_listing}
        self.stdlib = set(getattr(sys, "stdlib_module_names", ())) - {"test", "__future__"}
        self.own_tops = {t for t in tops if t}
        self.runner_names = frozenset(self.own_tops & {"pytest", "_pytest", "unittest", "pluggy"})

    def declared(self, rel: str) -> bool:
        return any(fnmatch.fnmatchcase(rel, g) for g in self.code_under_test)

    def classify(self, rel: str, kind: str | None, data: bytes | None, orig_data: bytes | None) -> str | None:
        """None when the change of `rel` (to `data`, None for a deletion) is carried, else the class
        of what it is (see the module docstring)."""
        name = rel.rsplit("/", 1)[-1]
        if rel in self.test_files:
            return "test-file"
        if name == "conftest.py" and not self.declared(rel):
            return "conftest"
        if name in CONFIGS and not self.declared(rel):
            mine = pytest_part(name, data) if data is not None and kind == "file" else "(removed)"
            theirs = pytest_part(name, orig_data) if orig_data is not None else ""
            if mine != theirs and (data is not None or theirs):
                return "test-config"
        if data is None:
            return None  # a deletion of anything else is the agent's to make
        if kind == "symlink":
            return "symlink"
        stem = name.split(".", 1)[0]
        if name.endswith(".pth") or (stem in STARTUP and name.endswith((".py", ".pyc", ".so"))):
            return "startup-hook"
        if rel.endswith(BYTECODE):
            return "bytecode"
        if data == b"\x00large":
            return "large"
        if not _is_text(data):
            return "binary"
        if self.shadow_rule and rel not in self.orig:
            top = _top_module(rel)
            if top is not None and top not in self.own_tops and (top in RUNNER or top in self.stdlib):
                return "runner-shadow"
        return None


def _open_parent(root_fd: int, rel: str, create: bool) -> tuple[int, str]:
    """(a descriptor of `rel`'s parent directory under `root_fd`, the last name), never through a
    symlink; with `create`, making missing directories (0o755)."""
    *dirs, name = rel.split("/")
    fd = os.dup(root_fd)
    try:
        for d in dirs:
            try:
                nfd = os.open(d, _DIR, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(d, 0o755, dir_fd=fd)
                nfd = os.open(d, _DIR, dir_fd=fd)
            except NotADirectoryError:
                if not create:
                    raise
                os.unlink(d, dir_fd=fd)  # a file (or link) of the pristine tree the change made a folder
                os.mkdir(d, 0o755, dir_fd=fd)
                nfd = os.open(d, _DIR, dir_fd=fd)
            os.close(fd)
            fd = nfd
    except BaseException:
        os.close(fd)
        raise
    return fd, name


def _remove(dfd: int, rel: str) -> None:
    try:
        pfd, name = _open_parent(dfd, rel, create=False)
    except OSError:
        return
    try:
        os.unlink(name, dir_fd=pfd)
    except OSError:
        pass
    finally:
        os.close(pfd)


def _write(dfd: int, rel: str, data: bytes, mode: int) -> None:
    pfd, name = _open_parent(dfd, rel, create=True)
    try:
        try:
            st = os.stat(name, dir_fd=pfd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                return  # a folder of the pristine tree where the change has a file: left as it is
            os.unlink(name, dir_fd=pfd)
        except FileNotFoundError:
            pass
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, mode, dir_fd=pfd)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        finally:
            os.close(fd)
    finally:
        os.close(pfd)


def _mode(root_fd: int, rel: str) -> int:
    """0o755 for a file the agent made executable, else 0o644 (what a git patch records)."""
    try:
        pfd, name = _open_parent(root_fd, rel, create=False)
    except OSError:
        return 0o644
    try:
        return 0o755 if os.stat(name, dir_fd=pfd, follow_symlinks=False).st_mode & 0o111 else 0o644
    except OSError:
        return 0o644
    finally:
        os.close(pfd)


def carry(src_fd: int, orig_fd: int, dest_fd: int, carrier: Carrier, max_bytes: int, write) -> dict:
    """Carry the change from ORIG to SRC onto DEST (a copy of ORIG); the diff of what was carried to
    `write`. -> {"carried": n, "excluded": [{path, class}], "levers": [...], "carried_sha256": hex}."""
    seen: list = []
    old = carrier.orig
    new = list_tree(src_fd, seen=seen)
    excluded = [{"path": rel, "class": "vcs" if rel.rsplit("/", 1)[-1] in VCS else "cache"} for rel in seen]
    excluded = [e for e in excluded if e["path"] not in old]
    writes, deletes, lever_hits, size, truncated = [], [], [], 0, False
    for rel in sorted(set(old) | set(new)):
        a = read_entry(orig_fd, rel, old[rel]) if rel in old else None
        b = read_entry(src_fd, rel, new[rel]) if rel in new else None
        if a == b and old.get(rel) == new.get(rel):
            continue
        if b is None and rel in new:
            continue  # vanished while read: the pristine version stays
        cls = carrier.classify(rel, new.get(rel), b, a if old.get(rel) == "file" else None)
        if cls is not None:
            excluded.append({"path": rel, "class": cls})
            continue
        if b is None:
            deletes.append(rel)
        else:
            writes.append((rel, b))
            if rel.endswith(".py") and carrier.levers is not None:  # bytes: parsed as import parses them
                old_bytes = a if a is not None and a != b"\x00large" and not a.startswith(b"symlink -> ") else None
                found = carrier.levers.new_levers(b, old_bytes, rel, runner_names=carrier.runner_names)
                lever_hits.extend(found)
        if not truncated:
            for line in file_patch(rel, a, b, (old.get(rel), new.get(rel))):
                size += len(line.encode("utf-8", "replace"))
                if size > max_bytes:
                    write(TRUNCATED)
                    truncated = True
                    break
                write(line)
    # what was carried, whole (the diff may be cut at max_bytes and says no file mode): the graded
    # tree is ORIG with these deletions and writes, so equal hashes are equal trees (a grade cache key)
    tree = hashlib.sha256()
    for rel in deletes:
        _remove(dest_fd, rel)
        tree.update(b"D%d:%s" % (len(os.fsencode(rel)), os.fsencode(rel)))
    for rel, data in writes:
        mode = _mode(src_fd, rel)
        _write(dest_fd, rel, data, mode)
        tree.update(b"W%d:%s%o:%d:" % (len(os.fsencode(rel)), os.fsencode(rel), mode, len(data)) + data)
    if len(excluded) > MAX_EXCLUDED:  # e.g. a __pycache__ in every folder the agent's runs touched
        more = len(excluded) - MAX_EXCLUDED
        excluded = excluded[:MAX_EXCLUDED] + [{"path": f"... and {more} more", "class": "truncated"}]
    return {
        "carried": len(writes) + len(deletes),
        "excluded": excluded,
        "levers": lever_hits,
        "carried_sha256": tree.hexdigest(),
    }


def _load_levers(source: str):
    module = types.ModuleType("levers")
    exec(compile(source, "levers.py", "exec"), module.__dict__)  # noqa: S102 - the server's own module
    return module


def main(argv: list[str]) -> int:
    src, dest, orig, max_bytes = argv[0], argv[1], argv[2], int(argv[3])
    policy, levers, modules = ({}, None, argv[4:]) if not orig else (json.loads(argv[4]), argv[5], argv[6:])
    sfd, dfd = os.open(src, _DIR), os.open(dest, _DIR)
    facts: dict = {}
    if not orig:
        copy_dir(sfd, dfd)
    else:
        ofd = os.open(orig, _DIR)
        copy_dir(ofd, dfd, skip=frozenset(CACHES))
        carrier = Carrier(policy, list_tree(ofd), _load_levers(levers) if levers else None)
        out = open(sys.stdout.fileno(), "w", encoding="utf-8", errors="replace", closefd=False)
        facts = carry(sfd, ofd, dfd, carrier, max_bytes, out.write)
        out.flush()
    missing = []
    for module in modules:
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(module)
    facts = {"python": sys.executable, "version": sys.version.split()[0], "missing": missing, **counts, **facts}
    sys.stderr.write(json.dumps(facts) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
