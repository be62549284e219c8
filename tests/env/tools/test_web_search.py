"""web_search and read_page: the offline documentation index (a fake package, and the installed
pytest), the SearXNG backend against a real local HTTP server speaking its JSON, the refusal of
private hosts (a rebinding name and a redirect included, with a stub resolver: no network), and a
session offered only the tools its task allows (HTTP and MCP)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import socket
import ssl
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from support.live_server import FIXTURE_TASKS

from composer_jax.env.api.protocol import BASE_TOOL_NAMES, TOOL_NAMES, ToolError
from composer_jax.env.cli import _make_web_tools, server_parser
from composer_jax.env.tools import doc_index
from composer_jax.env.tools.doc_index import DocIndex
from composer_jax.env.tools.html_text import html_to_text
from composer_jax.env.tools.web_search import (
    MAX_PAGE_CHARS,
    OfflineBackend,
    SearxngBackend,
    WebTools,
    _PinnedHTTPSConnection,
    check_host,
    make_web_tools,
    task_wants_web,
)
from composer_jax.errors import UsageError

GEO = '''"""Geometry on the sphere."""
raise RuntimeError("the index imported this module")


def haversine_distance(lat1, lon1, lat2, lon2, radius=6371.0):
    """Great-circle distance between two points on a sphere, from their latitudes and longitudes."""
    return 0.0


class Polygon:
    """A closed shape of straight edges."""

    def area(self):
        """The area enclosed by the polygon's edges (shoelace formula)."""

    def _private(self):
        """Never indexed."""
'''


def fake_site(root: Path, version: str = "1.0") -> Path:
    """A site directory holding one distribution, fakegeo, whose module raises when imported."""
    site = root / "site"
    (site / "fakegeo").mkdir(parents=True, exist_ok=True)
    (site / "fakegeo" / "__init__.py").write_text('"""Fake geometry helpers."""\n')
    (site / "fakegeo" / "sphere.py").write_text(GEO)
    info = site / f"fakegeo-{version}.dist-info"
    for old in site.glob("fakegeo-*.dist-info"):
        shutil.rmtree(old)
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fakegeo\nVersion: {version}\n")
    (info / "RECORD").write_text(f"fakegeo/__init__.py,,\nfakegeo/sphere.py,,\n{info.name}/METADATA,,\n")
    return site


def test_html_text_keeps_paragraphs_and_drops_scripts():
    title, text = html_to_text(
        "<html><head><title>The  Page</title><script>var x = 1;</script></head>"
        "<body><h1>Intro</h1><p>First &amp; one.</p><ul><li>a</li><li>b</li></ul><style>p{}</style>"
        "<pre>  keep\n    indent</pre></body></html>"
    )
    assert title == "The Page"
    assert text == "# Intro\n\nFirst & one.\n\n- a\n- b\n\n  keep\n    indent", text
    assert "var x" not in text


def test_fake_package_index_finds_by_meaning_without_importing(tmp_path):
    site = fake_site(tmp_path)
    index = DocIndex(["fakegeo"], cache_dir=tmp_path / "cache", search_path=[str(site)])
    (score, top), *_ = index.search("distance between two points on a sphere", 3)
    assert top.url == "pydoc://fakegeo.sphere.haversine_distance" and score > 0
    assert top.title == "fakegeo.sphere.haversine_distance(lat1, lon1, lat2, lon2, radius=6371.0)"
    assert top.package == "fakegeo 1.0"
    assert index.search("enclosed area, shoelace formula", 1)[0][1].url == "pydoc://fakegeo.sphere.Polygon.area"
    assert index.get("pydoc://fakegeo.sphere.Polygon._private") is None  # private names are left out
    assert index.search("zebra", 3) == []
    page = OfflineBackend(index).read("pydoc://fakegeo.sphere.haversine_distance")
    assert "def haversine_distance(" in page["content"] and "class Polygon" not in page["content"]
    with pytest.raises(ToolError, match="not a page of the offline documentation index"):
        OfflineBackend(index).read("https://example.com/")


def test_index_is_cached_by_package_set(tmp_path):
    site = fake_site(tmp_path)
    first = DocIndex(["fakegeo"], cache_dir=tmp_path / "cache", search_path=[str(site)])
    first.ensure()
    again = DocIndex(["fakegeo"], cache_dir=tmp_path / "cache", search_path=[str(site)])
    assert not first.from_cache and again.key() == first.key()
    assert again.search("sphere distance", 2) == first.search("sphere distance", 2) and again.from_cache
    site = fake_site(tmp_path, "2.0")  # another version of the package: another index
    bumped = DocIndex(["fakegeo"], cache_dir=tmp_path / "cache", search_path=[str(site)])
    assert bumped.key() != first.key()
    bumped.ensure()
    assert not bumped.from_cache and len(list((tmp_path / "cache").iterdir())) == 2


def test_unknown_package_and_bad_docs_dir_are_named(tmp_path):
    with pytest.raises(ValueError, match="not installed in this environment: no-such-dist-cj; installed: .*pytest"):
        DocIndex(["no-such-dist-cj"])
    with pytest.raises(ValueError, match="--docs-dir .*missing is not a directory"):
        DocIndex(["pytest"], docs_dir=tmp_path / "missing")


def test_docs_dir_pages_are_searched_and_read(tmp_path):
    docs = tmp_path / "docs"
    (docs / "guide").mkdir(parents=True)
    (docs / "guide" / "deploy.html").write_text(
        "<title>Deploying</title><p>Roll out the service behind a load balancer.</p>"
    )
    (docs / "notes.md").write_text("# Caching\n\nEvict entries with least-recently-used order.\n")
    site = fake_site(tmp_path)
    backend = OfflineBackend(DocIndex(["fakegeo"], docs_dir=docs, search_path=[str(site)]))
    hits = backend.search("load balancer rollout", 2)
    assert hits[0]["url"] == "docs://guide/deploy.html" and hits[0]["title"] == "Deploying"
    assert backend.search("least recently used eviction", 1)[0]["url"] == "docs://notes.md"
    page = backend.read("docs://guide/deploy.html")
    assert page["content"] == "Roll out the service behind a load balancer." and page["next_offset"] is None


def test_installed_pytest_is_found_by_a_natural_language_query():
    # a real distribution of the server's environment: pytest's `approx`, read from its source
    backend = OfflineBackend(DocIndex(["pytest"]))
    hits = backend.search("compare floating point numbers approximately", 3)
    assert "pydoc://_pytest.approx.approx" in [h["url"] for h in hits], hits
    assert all(h["source"].startswith("pytest ") for h in hits)
    page = backend.read("pydoc://_pytest.approx.approx")
    assert "def approx(" in page["content"] and "tolerance" in page["content"]


class _Stub(BaseHTTPRequestHandler):
    """SearXNG's /search?format=json answer, two pages, and a redirect to the cloud metadata address."""

    hosts: list[str] = []  # the Host header of every request, in order

    def do_GET(self):  # noqa: N802 - http.server's name
        _Stub.hosts.append(self.headers.get("Host", ""))
        if self.path == "/to-metadata":
            self.send_response(302)
            self.send_header("Location", "http://169.254.169.254/latest/meta-data/")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self.path.startswith("/search?"):
            assert "format=json" in self.path and "q=numpy+broadcasting" in self.path, self.path
            body = json.dumps(
                {
                    "query": "numpy broadcasting",
                    "results": [
                        {"url": "https://numpy.org/doc/broadcasting.html", "title": "Broadcasting", "content": "How "},
                        {"url": "https://example.org/b", "title": "Second", "content": "x" * 1000},
                        {"title": "no url: skipped"},
                    ],
                }
            ).encode()
            ctype = "application/json"
        elif self.path == "/page":
            body, ctype = b"<title>Stub</title><p>Hello <b>page</b></p>" + b"<p>" + b"y" * 30000 + b"</p>", "text/html"
        else:
            self.send_response(404)
            self.end_headers()
            return
        self.send_response(200)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.fixture
def stub_url():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_searxng_backend_against_a_local_server(stub_url):
    backend = SearxngBackend(stub_url, allow_private=True)
    hits = backend.search("numpy broadcasting", 5)
    assert [h["url"] for h in hits] == ["https://numpy.org/doc/broadcasting.html", "https://example.org/b"]
    assert hits[0] == {"title": "Broadcasting", "url": "https://numpy.org/doc/broadcasting.html", "snippet": "How"}
    assert len(hits[1]["snippet"]) == 300 and hits[1]["snippet"].endswith("...")
    assert len(backend.search("numpy broadcasting", 1)) == 1
    page = backend.read(stub_url + "/page")
    assert page["title"] == "Stub" and page["content"].startswith("Hello page\n\nyyy")
    assert len(page["content"]) == MAX_PAGE_CHARS and page["next_offset"] == MAX_PAGE_CHARS
    rest = backend.read(stub_url + "/page", page["next_offset"])
    assert rest["next_offset"] is None and rest["content"].endswith("y")
    with pytest.raises(ToolError, match="HTTP 404"):
        backend.read(stub_url + "/missing")


def test_private_hosts_are_refused_unless_allowed(stub_url):
    # the search API is the operator's (may be local); pages the agent asks for may not be
    backend = SearxngBackend(stub_url)
    assert backend.search("numpy broadcasting", 1)
    with pytest.raises(ToolError, match=r"refused: '127.0.0.1' resolves to 127.0.0.1.*--web-fetch-private"):
        backend.read(stub_url + "/page")
    for host in ("localhost", "10.1.2.3", "169.254.169.254", "::1", "192.168.0.1"):
        with pytest.raises(ToolError, match="--web-fetch-private"):
            check_host(host, allow_private=False)
    assert check_host("10.1.2.3", allow_private=True) == ["10.1.2.3"]
    with pytest.raises(ToolError, match="fetches http:// and https:// URLs"):
        backend.read("file:///etc/passwd")
    with pytest.raises(ToolError, match="fetches http:// and https:// URLs"):
        backend.read("http://example.org:http/")


PUBLIC = "93.184.216.34"  # what the stub resolver answers for a name first (a public address)


@pytest.fixture
def net(monkeypatch):
    """The network, stubbed: `answers[name]` is the list of address lists a name resolves to, one per
    lookup (a rebinding name answers a public address, then a private one); every connection is
    recorded by the address it was made to and then reaches `net.port` on 127.0.0.1 (the local stub
    server standing in for the public host)."""
    real_getaddrinfo = socket.getaddrinfo
    state = argparse.Namespace(answers={}, lookups=[], connects=[], port=0)

    def getaddrinfo(host, port, *args, **kwargs):
        if host not in state.answers:
            return real_getaddrinfo(host, port, *args, **kwargs)
        state.lookups.append(host)
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port or 0)) for a in state.answers[host].pop(0)]

    def create_connection(address, timeout=None, *args, **kwargs):
        state.connects.append(address)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        sock.connect(("127.0.0.1", state.port))  # an IP literal: no lookup
        return sock

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(socket, "create_connection", create_connection)
    return state


def test_read_page_connects_to_the_address_it_checked(stub_url, net):
    """DNS rebinding: a name that answers a public address to the check and a private one to a
    second lookup. read_page resolves once and connects to the checked address, with the URL's
    name in Host; a redirect into the private network is refused as a first URL is."""
    net.port = port = int(stub_url.rsplit(":", 1)[1])
    net.answers["docs.example"] = [[PUBLIC], ["127.0.0.1"]]
    backend = SearxngBackend("http://search.invalid")
    page = backend.read(f"http://docs.example:{port}/page")
    assert page["title"] == "Stub" and page["content"].startswith("Hello page")
    assert net.lookups == ["docs.example"] and net.connects == [(PUBLIC, port)]
    assert _Stub.hosts[-1] == f"docs.example:{port}"
    # the second answer, had it been asked for, is a private address: refused before any connection
    with pytest.raises(ToolError, match="refused: 'docs.example' resolves to 127.0.0.1"):
        backend.read(f"http://docs.example:{port}/page")
    assert net.connects == [(PUBLIC, port)]

    net.answers["docs.example"] = [[PUBLIC]]
    with pytest.raises(ToolError, match="refused: '169.254.169.254' resolves to 169.254.169.254"):
        backend.read(f"http://docs.example:{port}/to-metadata")
    assert net.connects == [(PUBLIC, port)] * 2  # the first hop only
    # a name with a public and a private address is refused whichever comes first
    net.answers["mixed.example"] = [[PUBLIC, "10.0.0.7"]]
    with pytest.raises(ToolError, match="resolves to 10.0.0.7"):
        backend.read(f"http://mixed.example:{port}/page")


@pytest.fixture
def tls_stub(tmp_path):
    """A local HTTPS server (the stub's pages) whose self-signed certificate names docs.example."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=docs.example"]
        + ["-addext", "subjectAltName=DNS:docs.example", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Stub)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server.server_address[1], cert
    server.shutdown()
    server.server_close()


def test_https_is_verified_against_the_url_name(tls_stub, net, monkeypatch):
    """Connected to the checked address, TLS still sends the URL's name (SNI) and checks the
    certificate against it: a certificate for docs.example is accepted for docs.example only."""
    net.port, cert = tls_stub
    monkeypatch.setattr(_PinnedHTTPSConnection, "tls", ssl.create_default_context(cafile=str(cert)))
    net.answers.update({"docs.example": [[PUBLIC]], "other.example": [[PUBLIC]]})
    backend = SearxngBackend("http://search.invalid")
    assert backend.read(f"https://docs.example:{net.port}/page")["title"] == "Stub"
    assert net.connects == [(PUBLIC, net.port)] and _Stub.hosts[-1] == f"docs.example:{net.port}"
    with pytest.raises(ToolError, match="certificate verify failed: Hostname mismatch"):
        backend.read(f"https://other.example:{net.port}/page")
    monkeypatch.setattr(_PinnedHTTPSConnection, "tls", ssl.create_default_context())  # the system's CAs
    net.answers["docs.example"] = [[PUBLIC]]
    with pytest.raises(ToolError, match="certificate verify failed"):
        backend.read(f"https://docs.example:{net.port}/page")


def test_flags_and_task_key_are_checked(tmp_path):
    assert make_web_tools("off") is None
    with pytest.raises(ValueError, match="--web-search 'bing'; accepted: offline, searxng:URL, off"):
        make_web_tools("bing")
    with pytest.raises(ValueError, match="needs an http"):
        make_web_tools("searxng:ftp://x")
    args = server_parser().parse_args(["--tasks", str(tmp_path), "--docs-packages", "no-such-dist-cj"])
    with pytest.raises(UsageError, match="no-such-dist-cj"):
        _make_web_tools(args)
    args = argparse.Namespace(**{**vars(args), "docs_packages": ["pytest"], "web_search": "offline"})
    assert isinstance(_make_web_tools(args).backend, OfflineBackend)
    assert task_wants_web({"agent": {"web_search": True}}) and not task_wants_web({})
    with pytest.raises(ValueError, match=r"\[agent\] web_search = 'yes' must be true or false"):
        task_wants_web({"agent": {"web_search": "yes"}}, "t/task.toml")


# ---------------------------------------------------------------------------- sessions
@pytest.fixture
def web_app(tmp_path):
    from fastapi.testclient import TestClient

    from composer_jax.env.sandbox.runner import LocalProcessSandbox
    from composer_jax.env.server.app import create_app
    from composer_jax.env.server.mcp_http import HostPolicy
    from composer_jax.env.server.session import SessionManager
    from composer_jax.env.tasks.store import TaskStore

    tasks = tmp_path / "tasks"
    shutil.copytree(FIXTURE_TASKS / "fix-add", tasks / "fix-add")
    for name, value in (("web-add", "true"), ("bad-web", '"yes"')):
        shutil.copytree(FIXTURE_TASKS / "fix-add", tasks / name)
        toml = tasks / name / "task.toml"
        toml.write_text(toml.read_text().replace("[agent]\n", f"[agent]\nweb_search = {value}\n"))
    site = fake_site(tmp_path)
    web = WebTools(OfflineBackend(DocIndex(["fakegeo"], search_path=[str(site)])), "tasks")
    manager = SessionManager(
        TaskStore(tasks, tmp_path / "cache"), LocalProcessSandbox(), work_dir=tmp_path / "w", web_tools=web
    )
    headers = {"Authorization": "Bearer " + "t" * 32}
    hosts = HostPolicy.for_bind("127.0.0.1", ["testserver"])  # TestClient's Host
    with TestClient(create_app(manager, "t" * 32, hosts=hosts), headers=headers) as client:
        yield client


def _rpc(client, method, **params):
    return client.post("/mcp", json={"jsonrpc": "2.0", "id": 1, "method": method, "params": params}).json()


def test_a_session_is_offered_only_the_tools_its_task_allows(web_app):
    # without a session: what every session gets (the web tools only with --web-search-offer all)
    assert [t["function"]["name"] for t in web_app.get("/tools").json()] == list(BASE_TOOL_NAMES)
    assert [t["name"] for t in _rpc(web_app, "tools/list")["result"]["tools"]] == list(BASE_TOOL_NAMES)
    plain = web_app.post("/sessions", json={"task_id": "fix-add"}).json()
    assert [t["function"]["name"] for t in plain["tools"]] == list(BASE_TOOL_NAMES)
    r = web_app.post(
        f"/sessions/{plain['session_id']}/tools", json={"calls": [{"name": "web_search", "arguments": {"query": "q"}}]}
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "unknown_tool"
    assert "web_search" in r.json()["error"]["message"] and "in this session" in r.json()["error"]["message"]
    listed = _rpc(web_app, "tools/list", session_id=plain["session_id"])["result"]["tools"]
    assert [t["name"] for t in listed] == list(BASE_TOOL_NAMES)
    called = _rpc(web_app, "tools/call", name="read_page", arguments={"url": "x"}, session_id=plain["session_id"])
    assert (
        called["result"]["is_error"]
        and "tool 'read_page' is not offered in this session" in called["result"]["data"]["error"]
    )

    web = web_app.post("/sessions", json={"task_id": "web-add"}).json()
    assert [t["function"]["name"] for t in web["tools"]] == TOOL_NAMES
    r = web_app.post(
        f"/sessions/{web['session_id']}/tools",
        json={"calls": [{"name": "web_search", "arguments": {"query": "great circle distance", "top_k": 2}}]},
    )
    [result] = r.json()["results"]
    assert result["ok"] and result["result"]["backend"] == "offline"
    assert result["result"]["results"][0]["url"] == "pydoc://fakegeo.sphere.haversine_distance"
    page = _rpc(
        web_app,
        "tools/call",
        name="read_page",
        arguments={"url": "pydoc://fakegeo.sphere.haversine_distance"},
        session_id=web["session_id"],
    )["result"]
    assert not page["is_error"] and "def haversine_distance" in page["data"]["content"]

    bad = web_app.post("/sessions", json={"task_id": "bad-web"})
    assert (
        bad.status_code == 400 and "[agent] web_search = 'yes' must be true or false" in bad.json()["error"]["message"]
    )


def test_offer_all_gives_every_session_the_tools(tmp_path):
    web = WebTools(OfflineBackend(DocIndex(["fakegeo"], search_path=[str(fake_site(tmp_path))])), "all")
    assert web.offered({}) and not WebTools(web.backend, "tasks").offered({})
    from composer_jax.env.sandbox.runner import LocalProcessSandbox
    from composer_jax.env.server.session import SessionManager
    from composer_jax.env.tasks.store import TaskStore

    store = TaskStore(FIXTURE_TASKS, tmp_path / "cache")
    manager = SessionManager(store, LocalProcessSandbox(), work_dir=tmp_path / "w", web_tools=web)
    assert manager.offered_tools() == tuple(TOOL_NAMES) and manager.web_for(store.get("fix-add", 0)) is web.backend
    # with no web backend, a task's bad [agent] web_search is still an error naming it
    from composer_jax.env.api.errors import TaskError

    off = SessionManager(store, LocalProcessSandbox(), work_dir=tmp_path / "w2")
    bad = store.get("fix-add", 0)
    bad = dataclasses.replace(bad, config=dataclasses.replace(bad.config, raw={"agent": {"web_search": 1}}))
    assert off.offered_tools() == BASE_TOOL_NAMES and off.web_for(store.get("fix-add", 0)) is None
    with pytest.raises(TaskError, match=r"fix-add: \[agent\] web_search = 1 must be true or false"):
        off.web_for(bad)
    assert doc_index.stem("approximately") == doc_index.stem("approx") == "approx"


def test_websocket_steps_check_the_session_tools():
    from composer_jax.env.server import openenv_protocol as op

    action = {"tool_calls": [{"name": "web_search", "arguments": {"query": "q"}}, {"name": "list_dir"}]}
    [(_, _, refused), (_, _, ok)] = op.split_calls(action, BASE_TOOL_NAMES)
    assert "tool 'web_search' is not offered in this session" in refused and ok == ("list_dir", {})
    assert op.split_calls(action, TOOL_NAMES)[0][2] == ("web_search", {"query": "q"})
    assert [t["name"] for t in op.mcp_tools(names=BASE_TOOL_NAMES)] == list(BASE_TOOL_NAMES)
