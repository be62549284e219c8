"""Index builds reach their package sources and nothing else (env/sandbox/index_proxy.py, issue 40
item 3; issue 50 item 5): the proxy carries only the sources' hosts and ports, to the addresses
each was pinned at (a second resolution cannot move it), and a sandboxed build from a local index
whose setup.py reaches for a host loopback service and the link-local metadata address, directly
and through the proxy, reaches neither."""

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
from composer_jax.env.sandbox.pip_sources import PipSources
from composer_jax.env.sandbox.pyenv import EnvBuildError, EnvCache
from composer_jax.env.sandbox.runner import BubblewrapSandbox
from composer_jax.env.sandbox.spec import EnvSpec


def _resolver(table: dict[str, list[str]]):
    def resolve(host, port):
        if host not in table:
            raise OSError("Name or service not known")
        return table[host]

    return resolve


PYPI_HOSTS = [("pypi.org", 443), ("files.pythonhosted.org", 443)]


@pytest.mark.parametrize(
    "host, port, why",
    [
        ("evil.example", 443, "evil.example:443 is not a package source of this build"),
        ("pypi.org", 22, "pypi.org:22 is not a package source"),
        ("169.254.169.254", 80, "--index-proxy-allow 169.254.169.254:80 lets builds reach it"),
        ("nowhere.example", 443, "nowhere.example: cannot be resolved"),
    ],
)
def test_the_proxy_refuses_other_hosts_and_names_the_flag(host, port, why):
    pins = ip.pin([*PYPI_HOSTS, ("nowhere.example", 443)], resolve=_resolver({"pypi.org": ["203.0.113.80"]} | {
        "files.pythonhosted.org": ["203.0.113.80"]}))  # fmt: skip
    with pytest.raises(ip.ProxyRefused, match=why):
        ip.IndexProxy(pins).check(host, port)


def test_a_configured_source_is_trusted_at_its_pinned_address_and_never_resolved_again():
    """The machine's index at a reserved address (a company mirror, this machine's PyPI): carried,
    to the address it had when pinned, whatever the name resolves to later."""
    answers = iter([["10.1.2.3", "203.0.113.80"], ["169.254.169.254"]])
    calls: list[str] = []

    def resolve(host, port):
        calls.append(host)
        return next(answers)

    proxy = ip.IndexProxy(ip.pin([("Mirror.corp", 443)], resolve=resolve))
    assert proxy.check("MIRROR.corp", 443) == ("10.1.2.3", "203.0.113.80") and calls == ["Mirror.corp"]
    assert proxy.check("mirror.corp", 443) == ("10.1.2.3", "203.0.113.80") and calls == ["Mirror.corp"]


def test_requests_through_the_socket(tmp_path):
    """Over the Unix socket: a refused CONNECT answers 403 and is kept; a bad request line 400."""

    async def go():
        proxy = ip.IndexProxy({("pypi.org", 443): ("203.0.113.80",)})
        async with proxy.serving() as where:
            answers = []
            for line in (b"CONNECT 169.254.169.254:80 HTTP/1.1\r\n\r\n", b"hello\r\n\r\n"):
                reader, writer = await asyncio.open_unix_connection(str(where / ip.SOCKET))
                writer.write(line)
                answers.append(await reader.read())
                writer.close()
        return proxy, answers

    proxy, (refused, bad) = asyncio.run(go())
    assert refused.startswith(b"HTTP/1.1 403") and b"169.254.169.254:80 is not a package source" in refused
    assert bad.startswith(b"HTTP/1.1 400") and proxy.refused == [
        "169.254.169.254:80 is not a package source of this build (allowed: pypi.org:443); "
        "--index-proxy-allow 169.254.169.254:80 lets builds reach it"
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
        # the index is this machine's loopback at the port the test chose; nothing else there is
        cache = EnvCache(tmp_path / "cache", BubblewrapSandbox(), sources=PipSources(f"http://127.0.0.1:{port}/simple"))
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
def test_files_on_another_host_are_refused_with_the_flag_that_lets_them_through(tmp_path):
    """An index whose page links its files on another host (`localhost`, not the index's
    127.0.0.1): the build fails, its error and `source_problems` name the host and the flag; with
    `--index-proxy-allow localhost:PORT` the same build succeeds."""
    require_bwrap()
    index = tmp_path / "index"
    (index / "simple" / "tinypkg").mkdir(parents=True)
    (index / "files").mkdir()
    setup_py = "from setuptools import setup\nsetup(name='tinypkg', version='0.1', py_modules=[])\n"
    (index / "files" / "tinypkg-0.1.tar.gz").write_bytes(sdist_bytes("tinypkg", setup_py))
    server, port = _serve(index)
    link = f"http://localhost:{port}/files/tinypkg-0.1.tar.gz"
    (index / "simple" / "tinypkg" / "index.html").write_text(f'<html><body><a href="{link}">t</a></body></html>')
    sources = PipSources(f"http://127.0.0.1:{port}/simple")
    try:
        cache = EnvCache(tmp_path / "cache", BubblewrapSandbox(), sources=sources)
        with pytest.raises(EnvBuildError, match=rf"localhost:{port} is not a package source of this build"):
            asyncio.run(cache.ensure(EnvSpec(None, ("tinypkg",)), None))
        ((problem, builds),) = cache.source_problems.items()
        assert builds == 1 and f"--index-proxy-allow localhost:{port} lets builds reach it" in problem
        allowed = EnvCache(
            tmp_path / "cache2", BubblewrapSandbox(), sources=sources, proxy_allow=(("localhost", port),)
        )
        env = asyncio.run(allowed.ensure(EnvSpec(None, ("tinypkg",)), None))
    finally:
        server.shutdown()
    assert env.installed == ("tinypkg==0.1",) and allowed.source_problems == {}
