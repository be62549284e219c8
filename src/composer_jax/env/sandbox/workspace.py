"""Confined file access to a session's workspace (what the agent sees as /app).

The file tools run in the server process, not in the sandbox (a sandbox per `read_file` would
cost milliseconds each), so every path is confined here:

1. The agent's path is taken relative to /app (`src/x.py`, `/app/src/x.py`); any other absolute
   path is refused.
2. Symlinks inside the workspace are resolved by hand, with /app as the root: a link to
   `/app/y` or `../y` that stays inside is followed; a link anywhere else, or `..` above /app, is
   refused with PathEscapeError.
3. The resolved, symlink-free path is then opened one component at a time with O_NOFOLLOW relative
   to the previous directory's file descriptor. A concurrent `run_shell` that swaps a directory for
   a symlink between steps 2 and 3 makes the open fail instead of escaping: no time-of-check /
   time-of-use window.
FIFOs and devices are never opened for reading (O_NONBLOCK + fstat), so a planted FIFO cannot
hang a server thread.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from composer_jax.env.api import protocol
from composer_jax.env.api.protocol import APP, ToolError

MAX_SYMLINK_HOPS = 40
MAX_READ_BYTES = 8 * 2**20


class PathEscapeError(ToolError):
    """A path that would leave the workspace."""


def _split(path: str) -> list[str]:
    return [p for p in path.split("/") if p not in ("", ".")]


class Workspace:
    """The directory `root` on the host, seen by the agent as /app."""

    def __init__(self, root: Path, uid: int | None = None, gid: int | None = None):
        self.root = Path(root)
        self.uid = uid if (uid is not None and os.geteuid() == 0) else None
        self.gid = gid if gid is not None else uid

    # ---------------------------------------------------------------- path resolution
    def parts(self, path: str, *, follow_last: bool = True) -> list[str]:
        """Components of `path` relative to the workspace root, with in-workspace symlinks resolved.

        Components that do not exist yet are kept as given (for creating files)."""
        if not isinstance(path, str) or "\x00" in path:
            raise ToolError(f"path {path!r} must be a string without NUL bytes")
        if path == APP or path.startswith(APP + "/"):
            rel = path[len(APP) :]
        elif path.startswith("/"):
            raise PathEscapeError(
                f"path {path!r} is outside the workspace; use a path relative to /app or an absolute path under /app"
            )
        else:
            rel = path
        pending, hops = _split(rel), 0
        out: list[str] = []
        while pending:
            comp = pending.pop(0)
            if comp == "..":
                if not out:
                    raise PathEscapeError(f"path {path!r} leaves the workspace through '..'")
                out.pop()
                continue
            host = os.path.join(self.root, *out, comp)
            try:
                st = os.lstat(host)
            except FileNotFoundError:
                out.append(comp)
                continue
            except NotADirectoryError:
                raise ToolError(f"path {path!r}: {'/'.join(out)!r} is not a directory") from None
            if stat.S_ISLNK(st.st_mode) and (pending or follow_last):
                hops += 1
                if hops > MAX_SYMLINK_HOPS:
                    raise ToolError(f"path {path!r}: too many levels of symbolic links")
                target = os.readlink(host)
                if target.startswith("/"):
                    if not (target == APP or target.startswith(APP + "/")):
                        raise PathEscapeError(
                            f"path {path!r}: symlink {'/'.join(out + [comp])!r} points to "
                            f"{target!r}, outside the workspace"
                        )
                    out, pending = [], _split(target[len(APP) :]) + pending
                else:
                    pending = _split(target) + pending
                continue
            out.append(comp)
        return out

    def display(self, parts: list[str]) -> str:
        return "/".join([APP] + parts)

    # ---------------------------------------------------------------- descriptor walk
    def _open_dir(self, parts: list[str], *, create: bool = False) -> int:
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            for comp in parts:
                try:
                    nfd = os.open(comp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                except FileNotFoundError:
                    if not create:
                        raise ToolError(f"{self.display(parts)}: no such directory") from None
                    os.mkdir(comp, 0o755, dir_fd=fd)
                    if self.uid is not None:
                        os.chown(
                            comp,
                            self.uid,
                            self.gid if self.gid is not None else self.uid,
                            dir_fd=fd,
                            follow_symlinks=False,
                        )
                    nfd = os.open(comp, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                        raise ToolError(
                            f"{self.display(parts)}: {comp!r} is not a directory "
                            "(or was replaced by a symlink while being opened)"
                        ) from None
                    raise
                os.close(fd)
                fd = nfd
            return fd
        except BaseException:
            os.close(fd)
            raise

    def open_dir(self, path: str) -> tuple[int, list[str]]:
        """A directory descriptor for `path` (caller closes it) and its resolved parts."""
        parts = self.parts(path)
        return self._open_dir(parts), parts

    def read_bytes(self, path: str, limit: int = MAX_READ_BYTES) -> tuple[bytes, list[str]]:
        """Contents of a regular file (at most `limit` bytes; ToolError if larger)."""
        parts = self.parts(path)
        if not parts:
            raise ToolError(f"{path!r} is the workspace directory, not a file")
        dfd = self._open_dir(parts[:-1])
        try:
            try:
                fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
            except FileNotFoundError:
                raise ToolError(f"{self.display(parts)}: no such file") from None
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise ToolError(f"{self.display(parts)}: symlink changed while being opened") from None
                raise ToolError(f"{self.display(parts)}: {exc.strerror}") from None
        finally:
            os.close(dfd)
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if stat.S_ISDIR(st.st_mode):
                raise ToolError(f"{self.display(parts)} is a directory; use list_dir")
            if not stat.S_ISREG(st.st_mode):
                raise ToolError(f"{self.display(parts)} is not a regular file")
            if st.st_size > limit:
                raise ToolError(
                    f"{self.display(parts)} is {st.st_size} bytes; files over {limit} bytes "
                    "cannot be read with this tool (use run_shell with head/sed)"
                )
            return f.read(limit + 1)[:limit], parts

    def write_bytes(self, path: str, data: bytes, *, create_only: bool = False) -> tuple[bool, list[str]]:
        """Write a regular file (creating parent directories); returns (created, parts)."""
        parts = self.parts(path)
        if not parts:
            raise ToolError(f"{path!r} is the workspace directory, not a file")
        dfd = self._open_dir(parts[:-1], create=True)
        try:
            flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | (os.O_EXCL if create_only else 0)
            existed = True
            try:
                os.stat(parts[-1], dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                existed = False
            try:
                fd = os.open(parts[-1], flags, 0o644, dir_fd=dfd)
            except FileExistsError:
                raise ToolError(f"{self.display(parts)} already exists") from None
            except OSError as exc:
                if exc.errno == errno.ELOOP:
                    raise PathEscapeError(f"{self.display(parts)} is a symlink; edit its target instead") from None
                raise ToolError(f"{self.display(parts)}: {exc.strerror}") from None
            with os.fdopen(fd, "wb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    raise ToolError(f"{self.display(parts)} is not a regular file")
                f.truncate(0)
                f.write(data)
                if self.uid is not None:
                    os.fchown(f.fileno(), self.uid, self.gid if self.gid is not None else self.uid)
            return not existed, parts
        finally:
            os.close(dfd)

    # ---------------------------------------------------------------- tree walks
    def walk_files(
        self,
        path: str,
        *,
        max_file_bytes: int = 2**20,
        skip_dirs: tuple[str, ...] = (".git", "__pycache__", ".pytest_cache", "node_modules"),
    ) -> Iterator[tuple[str, bytes]]:
        """(display path, contents) for regular files under `path`, never following symlinks."""
        parts = self.parts(path)
        try:
            dfd = self._open_dir(parts)
        except ToolError:
            data, parts = self.read_bytes(path, max_file_bytes)
            yield self.display(parts), data
            return
        base = self.display(parts)
        try:
            for dirpath, dirnames, filenames, dirfd in os.fwalk(".", dir_fd=dfd, follow_symlinks=False):
                dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs)
                for name in sorted(filenames):
                    try:
                        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dirfd)
                    except OSError:
                        continue  # symlink, vanished, unreadable
                    with os.fdopen(fd, "rb") as f:
                        st = os.fstat(f.fileno())
                        if not stat.S_ISREG(st.st_mode) or st.st_size > max_file_bytes:
                            continue
                        data = f.read(max_file_bytes)
                    rel = os.path.normpath(os.path.join(dirpath, name))
                    yield f"{base}/{rel}", data
        finally:
            os.close(dfd)

    def list_entries(self, path: str, depth: int) -> Iterator[tuple[str, str, int]]:
        """(display path, kind, size) of entries under `path` to `depth` levels, sorted
        (`protocol.list_dir_entries`, which SFT data uses on a task's initial workspace too)."""
        dfd, parts = self.open_dir(path)
        try:
            yield from protocol.list_dir_entries(dfd, self.display(parts), depth)
        finally:
            os.close(dfd)
