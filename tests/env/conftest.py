"""Shared fixtures for the environment-server tests: a live server subprocess (support/live_server.py)
per module, an HTTP client to it, a fresh session."""

from __future__ import annotations

import pytest
from support.bwrap import require_bwrap
from support.live_server import LiveServer


@pytest.fixture(scope="module")
def server():
    require_bwrap()
    s = LiveServer()
    yield s
    s.stop()


@pytest.fixture
def http(server):
    with server.client() as c:
        yield c


@pytest.fixture
def session(http):
    """A fresh fix-add session, closed afterwards."""
    r = http.post("/sessions", json={"task_id": "fix-add"})
    assert r.status_code == 201, r.text
    sid = r.json()["session_id"]
    yield sid
    http.delete(f"/sessions/{sid}")


# The fixture tasks' own tests run inside the sandbox, never on the host.
collect_ignore_glob = ["fixtures/*"]
