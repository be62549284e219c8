"""A PEP 503 package index over HTTPS on 127.0.0.1, behind a certificate authority made for the test.

`authority(dir)` makes, with the `openssl` command line, a self-signed authority and a server
certificate for 127.0.0.1 (and localhost) signed by it: (ca.pem, server.pem, server.key).
`serve(wheels, cert, key)` answers the simple index's pages and files over TLS and yields the index
URL; `requests` counts what was asked for, so a test can tell the index was used.
"""

from __future__ import annotations

import contextlib
import html
import http.server
import re
import shutil
import ssl
import subprocess
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

_LEAF_EXTENSIONS = """\
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = IP:127.0.0.1, DNS:localhost
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
"""


def authority(where: Path) -> tuple[Path, Path, Path]:
    """(ca.pem, server.pem, server.key) under `where`; pytest.skip without openssl."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl command to make a certificate authority with")
    where.mkdir(parents=True, exist_ok=True)

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=where, check=True, capture_output=True)

    openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2",
        "-subj", "/CN=composer-jax test authority",
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
    )  # fmt: skip
    openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=127.0.0.1"
    )
    (where / "leaf.ext").write_text(_LEAF_EXTENSIONS)
    openssl(
        "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.pem", "-days", "2", "-extfile", "leaf.ext",
    )  # fmt: skip
    return where / "ca.pem", where / "server.pem", where / "server.key"


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@contextlib.contextmanager
def serve(wheels: list[Path], cert: Path, key: Path) -> Iterator[tuple[str, Counter]]:
    """Serve `wheels` as https://127.0.0.1:PORT/simple; yields (that URL, a Counter of paths asked for)."""
    projects: dict[str, list[Path]] = {}
    for wheel in wheels:
        projects.setdefault(_norm(wheel.name.split("-", 1)[0]), []).append(wheel)
    files = {w.name: w for w in wheels}
    requests: Counter = Counter()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - the http.server interface
            requests[self.path] += 1
            parts = [p for p in self.path.split("?", 1)[0].split("/") if p]
            if len(parts) == 2 and parts[0] == "simple" and _norm(parts[1]) in projects:
                links = "".join(
                    f'<a href="/files/{html.escape(w.name)}">{html.escape(w.name)}</a>\n'
                    for w in projects[_norm(parts[1])]
                )
                return self._send(f"<!DOCTYPE html><html><body>\n{links}</body></html>".encode(), "text/html")
            if len(parts) == 2 and parts[0] == "files" and parts[1] in files:
                return self._send(files[parts[1]].read_bytes(), "application/octet-stream")
            self.send_error(404)

        def _send(self, data: bytes, kind: str) -> None:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"https://127.0.0.1:{server.server_address[1]}/simple", requests
    finally:
        server.shutdown()
        server.server_close()
