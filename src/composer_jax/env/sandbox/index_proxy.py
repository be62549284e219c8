"""The package sources, and nothing else, for a sandboxed environment build.

A build from an index runs untrusted code (setup.py, a build backend) that must reach the index
and must not reach the host's loopback services, private networks or the link-local metadata
address. So the build keeps its own network namespace (no route anywhere) and gets one way out: an
HTTP proxy that this process serves on a Unix socket, bound into the sandbox, where a small
forwarder (`FORWARDER`, run by the build script) listens on the sandbox's own loopback for pip's
`--proxy http://127.0.0.1:PORT`. The proxy accepts `CONNECT host:port` (https) and absolute-form
requests (http) only for the hosts and ports of the package sources the machine's pip is
configured with (`pip_sources.py`: each index, a find-links URL, PyPI's file host with PyPI) and
those `--index-proxy-allow` adds, and connects only to the addresses each resolved to when the run
first built from it (`pin`): the user configured that index, so it is trusted where it was found,
a private mirror behind its own authority included; any other host is refused, and a second
resolution cannot move a connection elsewhere (DNS rebinding). Every refusal is kept (`refused`),
named in the build's error with the flag that changes it, and counted in the run's summary.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import tempfile
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from pathlib import Path
from urllib.parse import urlsplit

MOUNT = "/run/index-proxy"  # where the build sees the proxy's socket directory
SOCKET = "proxy.sock"
PORT = 3128  # the forwarder's port on the sandbox's loopback
HEAD_LIMIT = 64 * 1024


class ProxyRefused(Exception):
    """A request the proxy will not carry: a host that is not a package source, or one that could
    not be resolved when the run pinned it."""


def _resolve(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def pin(
    hosts: Iterable[tuple[str, int]], resolve: Callable[[str, int], list[str]] = _resolve
) -> dict[tuple[str, int], tuple[str, ...] | str]:
    """{(host, port): the addresses it resolves to now, or why it does not resolve}."""
    out: dict[tuple[str, int], tuple[str, ...] | str] = {}
    for host, port in hosts:
        try:
            addrs = tuple(resolve(host, port))
        except OSError as exc:
            out[(host, port)] = f"cannot be resolved ({exc})"
            continue
        out[(host, port)] = addrs or "resolves to nothing"
    return out


class IndexProxy:
    """The proxy (module docstring) over `pins`: {(host, port): pinned addresses, or why none}."""

    def __init__(self, pins: Mapping[tuple[str, int], Sequence[str] | str]):
        self.pins = {(h.lower(), p): a for (h, p), a in pins.items()}
        self.refused: list[str] = []
        self.carried = 0  # connections made

    @contextlib.asynccontextmanager
    async def serving(self) -> AsyncIterator[Path]:
        """Serve on a Unix socket in a fresh directory (mount it at MOUNT); -> the directory."""
        where = Path(tempfile.mkdtemp(prefix="cj-index-proxy-"))
        path = where / SOCKET
        server = await asyncio.start_unix_server(self._handle, path=str(path), limit=HEAD_LIMIT)
        os.chmod(where, 0o755)
        os.chmod(path, 0o666)  # the build's unprivileged uid connects
        try:
            yield where
        finally:
            server.close()
            with contextlib.suppress(Exception):
                await server.wait_closed()
            with contextlib.suppress(OSError):
                path.unlink()
                where.rmdir()

    def check(self, host: str, port: int) -> tuple[str, ...]:
        """The pinned addresses to connect to for (host, port); ProxyRefused naming why not and
        the flag that changes it."""
        host = host.lower().strip("[]")
        pinned = self.pins.get((host, port))
        if pinned is None:
            allowed = ", ".join(f"{h}:{p}" for h, p in sorted(self.pins)) or "none"
            raise ProxyRefused(
                f"{host}:{port} is not a package source of this build (allowed: {allowed}); "
                f"--index-proxy-allow {_authority(host, port)} lets builds reach it"
            )
        if isinstance(pinned, str):
            raise ProxyRefused(f"{host}: {pinned} when the run pinned its address (the machine's DNS)")
        return tuple(pinned)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            method, target = _request_line(head)
            host, port = _target(method, target)
            up_reader, up_writer = await _connect(self.check(host, port), port)
        except ProxyRefused as e:
            self.refused.append(str(e))
            await _answer(writer, b"403 Forbidden", str(e))
            return
        except (ValueError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:
            await _answer(writer, b"400 Bad Request", f"not a proxy request: {e}")
            return
        except OSError as e:
            await _answer(writer, b"502 Bad Gateway", f"cannot connect: {e}")
            return
        self.carried += 1
        if method == "CONNECT":
            writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
        else:
            up_writer.write(_origin_form(head, target))
        await asyncio.gather(_pump(reader, up_writer), _pump(up_reader, writer))


def _authority(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


async def _connect(addrs: Sequence[str], port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection to the first of the pinned addresses that answers."""
    last: OSError = OSError("no address")
    for ip in addrs:
        try:
            return await asyncio.open_connection(ip, port)
        except OSError as exc:
            last = exc
    raise last


def _request_line(head: bytes) -> tuple[str, str]:
    parts = head.split(b"\r\n", 1)[0].decode("latin-1").split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        raise ValueError(f"request line {head[:80]!r}")
    return parts[0].upper(), parts[1]


def _origin_form(head: bytes, target: str) -> bytes:
    """An absolute-form request as the origin server takes it: the request line's target becomes
    its path and query (RFC 9112, 3.2.1); the headers pass unchanged."""
    parts = urlsplit(target)
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    line, rest = head.split(b"\r\n", 1)
    method, _, version = line.split(b" ")
    return b" ".join((method, path.encode("latin-1"), version)) + b"\r\n" + rest


def _target(method: str, target: str) -> tuple[str, int]:
    """(host, port) of a CONNECT authority or an absolute-form http:// request target."""
    if method == "CONNECT":
        host, sep, port = target.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"CONNECT target {target!r}")
        return host, int(port)
    parts = urlsplit(target)
    if parts.scheme != "http" or not parts.hostname:
        raise ValueError(f"request target {target!r} (accepted: CONNECT host:port, or an absolute http:// URL)")
    return parts.hostname, parts.port or 80


async def _answer(writer: asyncio.StreamWriter, status: bytes, why: str) -> None:
    body = why.encode() + b"\n"
    writer.write(b"HTTP/1.1 " + status + b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
    with contextlib.suppress(OSError):
        await writer.drain()
    writer.close()


async def _pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
    try:
        while data := await src.read(65536):
            dst.write(data)
            await dst.drain()
    except OSError:
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            dst.write_eof()
        with contextlib.suppress(Exception):
            dst.close()


# Run by the build script inside the sandbox (the toolchain's python3): listens on the sandbox's
# loopback at PORT and carries each connection to the proxy's socket. argv: socket path, port.
FORWARDER = r"""
import socket, sys, threading
path, port = sys.argv[1], int(sys.argv[2])
srv = socket.socket()
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", port))
srv.listen(64)
print("ready", flush=True)
def pump(a, b):
    try:
        while True:
            data = a.recv(65536)
            if not data:
                break
            b.sendall(data)
    except OSError:
        pass
    try:
        b.shutdown(socket.SHUT_WR)
    except OSError:
        pass
def serve(c):
    u = socket.socket(socket.AF_UNIX)
    try:
        u.connect(path)
    except OSError:
        c.close()
        return
    t = threading.Thread(target=pump, args=(u, c), daemon=True)
    t.start()
    pump(c, u)
    t.join()
    c.close()
    u.close()
while True:
    conn, _ = srv.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""
