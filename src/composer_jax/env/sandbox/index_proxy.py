"""The package index, and nothing else, for a sandboxed environment build.

A build from an index runs untrusted code (setup.py, a build backend) that must reach the index
and must not reach the host's loopback services, private networks or the link-local metadata
address. So the build keeps its own network namespace (no route anywhere) and gets one way out: an
HTTP proxy that this process serves on a Unix socket, bound into the sandbox, where a small
forwarder (`FORWARDER`, run by the build script) listens on the sandbox's own loopback for pip's
`--proxy http://127.0.0.1:PORT`. The proxy accepts `CONNECT host:port` (https) and absolute-form
requests (http) only for the index's hosts and ports (`index_hosts`), resolves the name once, and
connects to the address it checked, which must be a global unicast address (no loopback, private,
link-local, shared, reserved or multicast range): a name that resolves inside is refused, and a
second resolution cannot move the connection (DNS rebinding). Every refusal is kept (`refused`) and
named in the build's error.
"""

from __future__ import annotations

import asyncio
import configparser
import contextlib
import ipaddress
import os
import socket
import tempfile
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path
from urllib.parse import urlsplit

PYPI = "https://pypi.org/simple"
# PyPI's simple index links its files on this host
PYPI_FILES = ("files.pythonhosted.org", 443)
MOUNT = "/run/index-proxy"  # where the build sees the proxy's socket directory
SOCKET = "proxy.sock"
PORT = 3128  # the forwarder's port on the sandbox's loopback
HEAD_LIMIT = 64 * 1024


class ProxyRefused(Exception):
    """A request the proxy will not carry: a host that is not the index's, or an address inside."""


def index_hosts(urls: Iterable[str]) -> set[tuple[str, int]]:
    """The (host, port) pairs a build may reach: each index URL's, and PyPI's file host with PyPI.
    Non-http(s) URLs (a file:// wheel folder) need no network and add nothing."""
    out: set[tuple[str, int]] = set()
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            continue
        out.add((parts.hostname.lower(), parts.port or (443 if parts.scheme == "https" else 80)))
        if parts.hostname.lower() == "pypi.org":
            out.add(PYPI_FILES)
    return out


def configured_indexes(paths: Iterable[str] = ("/etc/pip.conf", "/etc/xdg/pip/pip.conf")) -> list[str]:
    """The indexes a sandboxed pip without `--index-url` uses: the system configuration's (the
    sandbox shows the host's /etc, and no user configuration), else PyPI."""
    cfg = configparser.ConfigParser()
    cfg.read(list(paths))
    index = cfg.get("global", "index-url", fallback=PYPI)
    extra = cfg.get("global", "extra-index-url", fallback="").split()
    return [index, *extra]


def is_public(ip: str) -> bool:
    addr = ipaddress.ip_address(ip)
    return addr.is_global and not addr.is_multicast


def _resolve(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class IndexProxy:
    """The proxy (module docstring). `allow`: (address, port) pairs let through although not
    global, for a test's local index only."""

    def __init__(
        self,
        hosts: set[tuple[str, int]],
        *,
        resolve: Callable[[str, int], list[str]] = _resolve,
        allow: Iterable[tuple[str, int]] = (),
    ):
        self.hosts, self.resolve, self.allow = hosts, resolve, set(allow)
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

    async def check(self, host: str, port: int) -> str:
        """The address to connect to for (host, port); ProxyRefused naming why not."""
        host = host.lower().strip("[]")
        if (host, port) not in self.hosts:
            allowed = ", ".join(f"{h}:{p}" for h, p in sorted(self.hosts)) or "none"
            raise ProxyRefused(f"{host}:{port} is not the package index (allowed: {allowed})")
        try:
            addrs = await asyncio.to_thread(self.resolve, host, port)
        except OSError as e:
            raise ProxyRefused(f"{host}: cannot be resolved ({e})") from None
        for ip in addrs:
            if is_public(ip) or (ip, port) in self.allow:
                return ip
        raise ProxyRefused(f"{host} resolves to {', '.join(addrs) or 'nothing'}: not a public address")

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            method, target = _request_line(head)
            host, port = _target(method, target)
            ip = await self.check(host, port)
            up_reader, up_writer = await asyncio.open_connection(ip, port)
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
