"""The `web_search` and `read_page` tools' backends, and which sessions are offered them.

A backend answers `search(query, k)` -> [{title, url, snippet}] and `read(url, offset)` -> a page's
text, at most MAX_PAGE_CHARS characters from `offset`. Two:

* `OfflineBackend` (the default): the documentation index of `env/tools/doc_index.py` (the installed
  packages' docstrings, plus `--docs-dir` pages); needs no network. Its URLs are `pydoc://NAME`
  (read gives the definition's signature, docstring and source) and `docs://PATH`.
* `SearxngBackend`: a SearXNG-compatible search API (`GET {url}/search?q=...&format=json`), and a
  page reader that fetches http(s) pages and extracts their text (`env/tools/html_text.py`). A host
  whose addresses include a private, loopback, link-local or otherwise non-global one is refused
  (every address the name resolves to is checked, and again at each redirect) unless the server
  was started with `--web-fetch-private`: a session must not reach the server's own network. The
  name is resolved once per hop and the connection goes to an address that was checked (`Host`,
  TLS SNI and the certificate's name stay the URL's): resolving again to connect would let a name
  that answers a public address to the check and a private one to the connection (DNS
  rebinding) through. Environment proxies are not used, for the same reason.

`WebTools` is the server's configuration (`--web-search`, `--web-search-offer`): the backend, and
whether every session is offered the tools or only tasks whose task.toml sets
`[agent] web_search = true`. A session not offered them does not list them and cannot call them.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import socket
import ssl
import threading
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from composer_jax.env.api.protocol import ToolError
from composer_jax.env.tools.doc_index import DocIndex
from composer_jax.env.tools.html_text import html_to_text

MAX_PAGE_CHARS = 20_000
MAX_FETCH_BYTES = 4 * 2**20
MAX_SNIPPET_CHARS = 300
FETCH_TIMEOUT_S = 15.0
MAX_REDIRECTS = 5
REDIRECT_CODES = (301, 302, 303, 307, 308)
OFFER_MODES = ("tasks", "all")


class Backend(Protocol):
    name: str

    def prepare(self) -> None:
        """Called when a session is offered the tools: start any slow setup in the background."""

    def search(self, query: str, k: int) -> list[dict]: ...

    def read(self, url: str, offset: int = 0) -> dict: ...


def _snippet(text: str) -> str:
    flat = " ".join(text.split())
    return flat if len(flat) <= MAX_SNIPPET_CHARS else flat[: MAX_SNIPPET_CHARS - 3] + "..."


def page(url: str, title: str, text: str, offset: int = 0) -> dict:
    """read_page's result: MAX_PAGE_CHARS characters of `text` from `offset`; `next_offset` is
    where the rest starts (None at the end)."""
    if offset > len(text):
        raise ToolError(f"offset {offset} is past the end of {url} ({len(text)} characters)")
    end = offset + MAX_PAGE_CHARS
    return {
        "url": url,
        "title": title,
        "content": text[offset:end],
        "total_chars": len(text),
        "next_offset": end if end < len(text) else None,
    }


class OfflineBackend:
    name = "offline"

    def __init__(self, index: DocIndex):
        self.index = index
        self._started = False

    def prepare(self) -> None:
        # Build or load the index in a thread at the first session offered the tools, so a server
        # whose tasks never use them never pays for it, and the first web_search waits only for
        # what is left (DocIndex.ensure is idempotent and locked).
        if not self._started:
            self._started = True
            threading.Thread(target=self._warm, name="doc-index", daemon=True).start()

    def _warm(self) -> None:
        try:
            self.index.ensure()
        except Exception:  # noqa: BLE001 - the first web_search builds again and reports the error
            pass

    def search(self, query: str, k: int) -> list[dict]:
        return [
            {"title": d.title, "url": d.url, "snippet": _snippet(d.text), "source": d.package, "score": round(s, 3)}
            for s, d in self.index.search(query, k)
        ]

    def read(self, url: str, offset: int = 0) -> dict:
        doc = self.index.get(url)
        if doc is None:
            raise ToolError(
                f"{url!r} is not a page of the offline documentation index; read_page takes a url "
                "that web_search returned (pydoc://... or docs://...)"
            )
        try:
            raw = Path(doc.source).read_text("utf-8", "replace")
        except OSError as exc:
            raise ToolError(f"{url}: cannot read {doc.source}: {exc.strerror}") from None
        if doc.url.startswith("docs://"):
            text = html_to_text(raw)[1] if doc.source.lower().endswith((".html", ".htm")) else raw
        elif doc.lines == (0, 0):  # a module: its docstring, then its source
            text = f"{doc.title} ({doc.package})\n\n{raw}"
        else:
            lines = raw.splitlines()[doc.lines[0] - 1 : doc.lines[1]]
            text = f"{doc.title}  [{doc.package}, {doc.source}:{doc.lines[0]}]\n\n" + "\n".join(lines)
        return page(url, doc.title, text, offset)


# ---------------------------------------------------------------------------- the network backend
def check_host(host: str, allow_private: bool) -> list[str]:
    """The addresses `host` resolves to, resolved once: the only ones a fetch may connect to.
    Refuses a host with any non-global address (unless `allow_private`)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as exc:
        raise ToolError(f"cannot resolve host {host!r}: {exc}") from None
    addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
    for text in [] if allow_private else addresses:
        addr = ipaddress.ip_address(text.split("%")[0])
        if not addr.is_global or addr.is_multicast:
            raise ToolError(
                f"refused: {host!r} resolves to {addr}, a private, loopback, link-local or reserved address; "
                "the server fetches only public hosts unless started with --web-fetch-private"
            )
    return addresses


def check_url(url: str, allow_private: bool) -> tuple[urllib.parse.SplitResult, list[str]]:
    """An http(s) URL's parts and its host's checked addresses (`check_host`)."""
    parts = urllib.parse.urlsplit(url)
    try:
        valid = parts.scheme in ("http", "https") and bool(parts.hostname) and (parts.port or 0) >= 0
    except ValueError:  # a port that is not a number, or past 65535
        valid = False
    if not valid or not parts.hostname:
        raise ToolError(f"read_page fetches http:// and https:// URLs; got {url!r:.200}")
    return parts, check_host(parts.hostname, allow_private)


class _PinnedHTTPConnection(http.client.HTTPConnection):
    """An HTTP connection to `host` (its Host header) made to one of `addresses`, never resolved again."""

    def __init__(self, host: str, port: int | None, addresses: list[str], timeout: float):
        super().__init__(host, port, timeout=timeout)
        self.addresses = addresses

    def connect(self) -> None:
        error: OSError = OSError(f"no address to connect to for {self.host}")
        for address in self.addresses:
            try:
                self.sock = socket.create_connection((address, self.port), self.timeout)
                return
            except OSError as exc:
                error = exc
        raise error


class _PinnedHTTPSConnection(_PinnedHTTPConnection):
    """TLS over a pinned connection: SNI and the certificate check are for the URL's host name."""

    default_port = 443
    tls = ssl.create_default_context()

    def connect(self) -> None:
        super().connect()
        self.sock = self.tls.wrap_socket(self.sock, server_hostname=self.host)


def fetch(url: str, allow_private: bool, timeout_s: float, *, check_first: bool = True) -> tuple[bytes, str]:
    """GET `url` following redirects: (body, at most MAX_FETCH_BYTES + 1 bytes; Content-Type). Each
    hop's host is checked (`check_url`), the first one's only when `check_first`, and connected to at
    an address that check returned."""
    for _ in range(MAX_REDIRECTS + 1):
        parts, addresses = check_url(url, allow_private or not check_first)
        check_first = True
        kind = _PinnedHTTPSConnection if parts.scheme == "https" else _PinnedHTTPConnection
        conn = kind(parts.hostname or "", parts.port, addresses, timeout_s)
        target = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
        try:
            conn.request("GET", target, headers={"User-Agent": "composer-jax-env", "Accept": "*/*"})
            resp = conn.getresponse()
            location = resp.getheader("Location")
            if resp.status in REDIRECT_CODES and location:
                url = urllib.parse.urljoin(url, location)
                continue
            if resp.status >= 400:
                raise ToolError(f"{url}: HTTP {resp.status} {resp.reason}")
            return resp.read(MAX_FETCH_BYTES + 1), resp.getheader("Content-Type", "")
        except (OSError, http.client.HTTPException) as exc:
            raise ToolError(f"{url}: {exc}") from None
        finally:
            conn.close()
    raise ToolError(f"{url}: more than {MAX_REDIRECTS} redirects")


class SearxngBackend:
    name = "searxng"

    def __init__(self, base_url: str, allow_private: bool = False, timeout_s: float = FETCH_TIMEOUT_S):
        parts = urllib.parse.urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"--web-search searxng:URL needs an http(s) URL, got {base_url!r}")
        self.base_url, self.allow_private, self.timeout_s = base_url.rstrip("/"), allow_private, timeout_s

    def prepare(self) -> None:
        pass

    def search(self, query: str, k: int) -> list[dict]:
        # the search API is the operator's own service: it may be private (no host check; its redirects are)
        url = f"{self.base_url}/search?" + urllib.parse.urlencode({"q": query, "format": "json"})
        body, _ = fetch(url, self.allow_private, self.timeout_s, check_first=False)
        try:
            results = json.loads(body)["results"]
        except (ValueError, KeyError, TypeError):
            raise ToolError(f"{self.base_url} did not answer with SearXNG's JSON ({{'results': [...]}})") from None
        out = []
        for r in results if isinstance(results, list) else []:
            if isinstance(r, dict) and isinstance(r.get("url"), str):
                snippet = _snippet(str(r.get("content", "")))
                out.append({"title": str(r.get("title", "")), "url": r["url"], "snippet": snippet})
            if len(out) >= k:
                break
        return out

    def read(self, url: str, offset: int = 0) -> dict:
        body, ctype = fetch(url, self.allow_private, self.timeout_s)
        truncated = len(body) > MAX_FETCH_BYTES
        charset = "utf-8"
        if "charset=" in ctype:
            charset = ctype.split("charset=", 1)[1].split(";")[0].strip() or "utf-8"
        try:
            raw = body[:MAX_FETCH_BYTES].decode(charset, "replace")
        except LookupError:
            raw = body[:MAX_FETCH_BYTES].decode("utf-8", "replace")
        kind = ctype.split(";")[0].strip().lower()
        if kind in ("text/html", "application/xhtml+xml") or (not kind and "<html" in raw[:2000].lower()):
            title, text = html_to_text(raw)
        elif kind.startswith("text/") or kind in ("application/json", "application/xml", ""):
            title, text = "", raw
        else:
            raise ToolError(f"{url} is {kind}, not a text page")
        if truncated:
            text += f"\n[... page cut at {MAX_FETCH_BYTES} bytes]"
        return page(url, title, text, offset)


# ---------------------------------------------------------------------------- the server's configuration
@dataclass
class WebTools:
    """The web tools of a server: its backend and who is offered them (`offer`: tasks or all)."""

    backend: Backend
    offer: str = "tasks"

    def offered(self, task_raw: dict[str, Any], where: str = "task.toml") -> bool:
        if self.offer == "all":
            return True
        return task_wants_web(task_raw, where)


def task_wants_web(raw: dict[str, Any], where: str = "task.toml") -> bool:
    """task.toml's `[agent] web_search` (default false); a value that is not a boolean is an error."""
    agent = raw.get("agent", {})
    value = agent.get("web_search", False) if isinstance(agent, dict) else False
    if not isinstance(value, bool):
        raise ValueError(f"{where}: [agent] web_search = {value!r} must be true or false")
    return value


def make_web_tools(
    spec: str,
    *,
    offer: str = "tasks",
    docs_dir: Path | None = None,
    packages: list[str] | None = None,
    cache_dir: Path | None = None,
    fetch_private: bool = False,
) -> WebTools | None:
    """`--web-search SPEC` -> the server's web tools (None for `off`). ValueError names a bad value."""
    if offer not in OFFER_MODES:
        raise ValueError(f"--web-search-offer {offer!r}; accepted: {', '.join(OFFER_MODES)}")
    if spec == "off":
        return None
    if spec == "offline":
        return WebTools(OfflineBackend(DocIndex(packages, docs_dir, cache_dir)), offer)
    if spec.startswith("searxng:"):
        return WebTools(SearxngBackend(spec[len("searxng:") :], fetch_private), offer)
    raise ValueError(f"--web-search {spec!r}; accepted: offline, searxng:URL, off")
