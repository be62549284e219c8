"""A package index on loopback that knows when each file was uploaded, holding real wheels.

`serve(files)` answers PEP 691 JSON (`application/vnd.pypi.simple.v1+json`, api-version 1.1) with
PEP 700's `upload-time` for each file, the way PyPI's simple API does, so uv's `--exclude-newer`
resolves against it as against PyPI. `offline_wheels(requirements, dest)` takes the wheels from the
package indexes pip's configuration names as local folders (file:// URLs) and never
reaches the network; the test skips when they are not there.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import re
import shutil
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest

JSON_TYPE = "application/vnd.pypi.simple.v1+json"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def offline_wheels(requirements: list[str], dest: Path) -> dict[str, Path]:
    """{requirement ("name" or "name==version"): a pure-Python wheel of it} from the local (file://)
    indexes of pip's configuration, read as files (no pip run, never the network), copied into
    `dest`; pytest.skip when one is not there."""
    local = _local_indexes()
    if not local:
        pytest.skip("pip's configuration names no local (file://) index to take real wheels from")
    dest.mkdir(parents=True, exist_ok=True)
    out = {}
    for req in requirements:
        name, _, version = req.partition("==")
        found = next((w for url in local if (w := _wheel_in(url, name, version)) is not None), None)
        if found is None:
            pytest.skip(f"no local pure-Python wheel of {req} in {', '.join(local)}")
        out[req] = Path(shutil.copy(found, dest / found.name))
    return out


def _wheel_in(index_url: str, name: str, version: str) -> Path | None:
    """The first py3-none-any wheel of `name` (at `version`, when given) a file:// simple index lists."""
    page = Path(urllib.parse.urlsplit(index_url).path) / _norm(name) / "index.html"
    try:
        html = page.read_text()
    except OSError:
        return None
    stem = re.escape(re.sub(r"[-_.]+", "_", name))
    want = re.escape(version) if version else r"[^-]+"
    for href in re.findall(r'href="([^"#]+)', html):
        filename = href.rsplit("/", 1)[-1]
        if re.fullmatch(rf"(?i){stem}-{want}-(py3|py2\.py3)-none-any\.whl", filename):
            path = (page.parent / urllib.parse.unquote(href)).resolve()
            return path if path.is_file() else None
    return None


def _local_indexes() -> list[str]:
    """The file:// index URLs in pip's configuration, at every level (`pip config list`)."""
    proc = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True)
    urls = []
    for line in proc.stdout.splitlines():
        key, _, value = line.partition("=")
        if key.endswith(("index-url", "extra-index-url")):
            urls += [u for u in value.strip("'\"").split() if u.startswith("file://")]
    return list(dict.fromkeys(urls))


@contextlib.contextmanager
def serve(files: dict[Path, str]) -> Iterator[str]:
    """Serve {wheel: upload time (RFC 3339)} as a simple index; yields its URL (".../simple")."""
    projects: dict[str, list[dict]] = {}
    by_name = {}
    for path, uploaded in files.items():
        project = _norm(path.name.split("-", 1)[0])
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        entry = {"filename": path.name, "url": f"/files/{path.name}", "hashes": {"sha256": digest}}
        projects.setdefault(project, []).append({**entry, "upload-time": uploaded})
        by_name[path.name] = path

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_HEAD(self) -> None:  # noqa: N802 - uv asks for a wheel's size before a range request
            self.head_only = True
            self.do_GET()

        def do_GET(self) -> None:  # noqa: N802 - the http.server interface
            parts = [p for p in self.path.split("?", 1)[0].split("/") if p]
            if parts == ["simple"]:
                body = {"meta": {"api-version": "1.1"}, "projects": [{"name": n} for n in sorted(projects)]}
                return self._send(json.dumps(body).encode(), JSON_TYPE)
            if len(parts) == 2 and parts[0] == "simple" and _norm(parts[1]) in projects:
                name = _norm(parts[1])
                body = {"meta": {"api-version": "1.1"}, "name": name, "files": projects[name]}
                return self._send(json.dumps(body).encode(), JSON_TYPE)
            if len(parts) == 2 and parts[0] == "files" and parts[1] in by_name:
                return self._send(by_name[parts[1]].read_bytes(), "application/octet-stream")
            self.send_error(404)

        def _send(self, data: bytes, kind: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if not getattr(self, "head_only", False):
                self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/simple"
    finally:
        server.shutdown()
        server.server_close()
