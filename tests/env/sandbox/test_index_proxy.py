"""Index builds reach the package index and nothing else (env/sandbox/index_proxy.py, issue 40
item 3): the proxy's rules (the index's hosts and ports only, public addresses only, the address it
checked is the one it connects to), and a sandboxed build from a local index whose setup.py reaches
for a host loopback service and the link-local metadata address, directly and through the proxy."""

from __future__ import annotations

import asyncio
import functools
import http.server
import textwrap
import threading
from pathlib import Path

import pytest
from support.bwrap import require_bwrap
from support.sdists import sdist_bytes

from composer_jax.env.sandbox import index_proxy as ip
from composer_jax.env.sandbox.pyenv import EnvBuildError, EnvCache
from composer_jax.env.sandbox.runner import BubblewrapSandbox
from composer_jax.env.sandbox.spec import EnvSpec


def _resolver(table: dict[str, list[str]]):
    return lambda host, port: table[host]


def test_index_hosts_and_the_configured_index(tmp_path):
    assert ip.index_hosts(["https://pypi.org/simple"]) == {("pypi.org", 443), ip.PYPI_FILES}
    assert ip.index_hosts(["http://mirror.example:8080/simple", "file:///opt/wheels"]) == {("mirror.example", 8080)}
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nindex-url = https://mirror.example/simple\nextra-index-url = https://b.example/x\n")
    assert ip.configured_indexes([str(conf)]) == ["https://mirror.example/simple", "https://b.example/x"]
    assert ip.configured_indexes([str(tmp_path / "none.conf")]) == [ip.PYPI]


@pytest.mark.parametrize(
    "host, port, addrs, why",
    [
        ("evil.example", 443, ["93.184.216.34"], "is not the package index"),
        ("pypi.org", 22, ["151.101.0.223"], "pypi.org:22 is not the package index"),
        ("pypi.org", 443, ["127.0.0.1"], "resolves to 127.0.0.1: not a public address"),
        ("pypi.org", 443, ["10.1.2.3", "169.254.169.254"], "not a public address"),
        ("pypi.org", 443, ["fe80::1"], "not a public address"),
        ("pypi.org", 443, ["100.64.0.1"], "not a public address"),  # shared address space
    ],
)
def test_the_proxy_refuses_other_hosts_and_inside_addresses(host, port, addrs, why):
    proxy = ip.IndexProxy(ip.index_hosts([ip.PYPI]), resolve=_resolver({host: addrs}))
    with pytest.raises(ip.ProxyRefused, match=why):
        asyncio.run(proxy.check(host, port))


def test_the_proxy_connects_to_the_address_it_checked():
    """A name with an inside and a public address: the public one is the one used (no second lookup)."""
    calls: list[str] = []

    def resolve(host, port):
        calls.append(host)
        return ["127.0.0.1", "151.101.0.223"]

    proxy = ip.IndexProxy(ip.index_hosts([ip.PYPI]), resolve=resolve)
    assert asyncio.run(proxy.check("PyPI.org", 443)) == "151.101.0.223" and calls == ["pypi.org"]


def test_requests_through_the_socket(tmp_path):
    """Over the Unix socket: a refused CONNECT answers 403 and is kept; a bad request line 400."""

    async def go():
        proxy = ip.IndexProxy({("pypi.org", 443)}, resolve=_resolver({}))
        async with proxy.serving() as where:
            answers = []
            for line in (b"CONNECT 169.254.169.254:80 HTTP/1.1\r\n\r\n", b"hello\r\n\r\n"):
                reader, writer = await asyncio.open_unix_connection(str(where / ip.SOCKET))
                writer.write(line)
                answers.append(await reader.read())
                writer.close()
        return proxy, answers

    proxy, (refused, bad) = asyncio.run(go())
    assert refused.startswith(b"HTTP/1.1 403") and b"169.254.169.254:80 is not the package index" in refused
    assert bad.startswith(b"HTTP/1.1 400") and proxy.refused == [
        "169.254.169.254:80 is not the package index (allowed: pypi.org:443)"
    ]


# ------------------------------------------------------------------ a sandboxed build from a local index
PROBE_SETUP = """
import os, socket, urllib.request
report = []
def direct(host, port):
    try:
        socket.create_connection((host, port), timeout=3).close()
        return "CONNECTED"
    except OSError as exc:
        return "REFUSED " + type(exc).__name__
report.append("DIRECT-LOOPBACK " + direct("127.0.0.1", {service}))
report.append("DIRECT-METADATA " + direct("169.254.169.254", 80))
opener = urllib.request.build_opener(urllib.request.ProxyHandler({{"http": "http://127.0.0.1:{proxy}"}}))
for url in ("http://127.0.0.1:{service}/secret", "http://169.254.169.254/latest/meta-data/"):
    try:
        report.append("PROXY " + url + " " + opener.open(url, timeout=5).read().decode())
    except Exception as exc:
        report.append("PROXY-REFUSED " + url + " " + str(getattr(exc, "code", type(exc).__name__)))
open("/opt/taskenv/probe-report.txt", "w").write("\\n".join(report))
from setuptools import setup
setup(name="probepkg", version="0.1")
"""


def _serve(root: Path) -> tuple[http.server.ThreadingHTTPServer, int]:
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, server.server_address[1]


@pytest.mark.sandbox
def test_a_build_from_the_index_reaches_it_and_nothing_else(tmp_path):
    require_bwrap()
    secret = tmp_path / "service"
    secret.mkdir()
    (secret / "secret").write_text("HOST-SERVICE-SECRET")
    service, service_port = _serve(secret)  # a service on the host's loopback
    index = tmp_path / "index"
    (index / "simple" / "probepkg").mkdir(parents=True)
    (index / "files").mkdir()
    setup_py = PROBE_SETUP.format(service=service_port, proxy=ip.PORT)
    (index / "files" / "probepkg-0.1.tar.gz").write_bytes(sdist_bytes("probepkg", textwrap.dedent(setup_py)))
    (index / "simple" / "probepkg" / "index.html").write_text(
        '<html><body><a href="/files/probepkg-0.1.tar.gz">probepkg-0.1.tar.gz</a></body></html>'
    )
    server, port = _serve(index)
    try:
        cache = EnvCache(
            tmp_path / "cache",
            BubblewrapSandbox(),
            index_url=f"http://127.0.0.1:{port}/simple",
            proxy_allow=(("127.0.0.1", port),),  # the test's index lives on loopback; nothing else does
        )
        env = asyncio.run(cache.ensure(EnvSpec(None, ("probepkg",)), None))
        report = (env.host_path / "probe-report.txt").read_text().splitlines()
    finally:
        server.shutdown()
        service.shutdown()
    assert report[0].startswith("DIRECT-LOOPBACK REFUSED") and report[1].startswith("DIRECT-METADATA REFUSED"), report
    assert report[2] == f"PROXY-REFUSED http://127.0.0.1:{service_port}/secret 403", report
    assert report[3] == "PROXY-REFUSED http://169.254.169.254/latest/meta-data/ 403", report
    assert "HOST-SERVICE-SECRET" not in "\n".join(report)


@pytest.mark.sandbox
def test_an_index_the_proxy_refuses_fails_the_build_and_says_why(tmp_path):
    """Without the test's allowance the loopback index itself is refused: the build error names it."""
    require_bwrap()
    cache = EnvCache(tmp_path / "cache", BubblewrapSandbox(), index_url="http://127.0.0.1:9/simple")
    with pytest.raises(EnvBuildError, match=r"the index proxy refused: 127\.0\.0\.1 resolves to 127\.0\.0\.1"):
        asyncio.run(cache.ensure(EnvSpec(None, ("probepkg",)), None))
