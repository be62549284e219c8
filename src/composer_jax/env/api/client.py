"""asyncio client for one or many environment servers.

`EnvClient(urls, token)` keeps one pooled HTTP/1.1 connection pool per server. A new session goes
to the healthy server with the fewest sessions this client holds there (ties broken round-robin);
if that server refuses (connection error, 5xx, 429 at capacity) the client backs off and tries the
next, marking a dead server down for `down_for_s`. Requests that are safe to repeat (GET, create
on a server that never answered) are retried with exponential back-off and jitter.

A session lives on one server. If that server dies, the session's state is gone: calls on it fail
fast with `SessionLost` (no retries), so the caller can restart the rollout elsewhere.

    async with EnvClient(["http://10.0.0.1:8000", "http://10.0.0.2:8000"], token) as client:
        session = await client.create_session("fix-add")
        results = await session.call_tools([("read_file", {"path": "calc.py"})])
        grade = await session.grade()
        await session.close()
"""

from __future__ import annotations

import asyncio
import itertools
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx


class EnvClientError(Exception):
    """Base class of the client's errors."""


class ServerUnavailable(EnvClientError):
    """No server accepted the request (all down, unreachable, or at capacity)."""


class SessionLost(EnvClientError):
    """The session's server is unreachable or no longer knows the session: restart the rollout."""

    def __init__(self, message: str, session_id: str, server: str):
        super().__init__(message)
        self.session_id, self.server = session_id, server


class RequestRejected(EnvClientError):
    """The server answered 4xx: the request itself is wrong (retrying will not help)."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(f"HTTP {status} {code}: {message}")
        self.status, self.code, self.message = status, code, message


_CONNECTION_ERRORS = (
    httpx.ConnectError,
    httpx.ConnectTimeout,
    httpx.RemoteProtocolError,
    httpx.ReadError,
    httpx.WriteError,
    httpx.PoolTimeout,
)


@dataclass
class _Server:
    url: str
    http: httpx.AsyncClient
    sessions: int = 0
    down_until: float = 0.0


@dataclass
class RemoteSession:
    """A session on one server; methods delegate to the client."""

    client: EnvClient
    server: _Server
    session_id: str
    task_id: str
    instruction: str
    tools: list[dict]
    info: dict = field(default_factory=dict)
    closed: bool = False

    @property
    def server_url(self) -> str:
        return self.server.url

    async def call_tools(self, calls: list[tuple[str, dict] | dict]) -> list[dict]:
        """Run calls (pairs (name, arguments) or {"name", "arguments", "id"?} dicts) in parallel."""
        body = {"calls": [c if isinstance(c, dict) else {"name": c[0], "arguments": c[1]} for c in calls]}
        return (await self.client._session_request(self, "POST", f"/sessions/{self.session_id}/tools", body))["results"]

    async def grade(self) -> dict:
        return await self.client._session_request(self, "POST", f"/sessions/{self.session_id}/grade", None)

    async def state(self) -> dict:
        return await self.client._session_request(self, "GET", f"/sessions/{self.session_id}", None)

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.server.sessions -= 1
        try:
            await self.client._session_request(self, "DELETE", f"/sessions/{self.session_id}", None)
        except (SessionLost, RequestRejected):
            pass  # gone already: nothing to close


class EnvClient:
    def __init__(
        self,
        urls: list[str] | str,
        token: str,
        *,
        timeout_s: float = 300.0,
        connect_timeout_s: float = 5.0,
        retries: int = 3,
        backoff_s: float = 0.1,
        max_connections: int = 256,
        down_for_s: float = 10.0,
    ):
        urls = [urls] if isinstance(urls, str) else list(urls)
        if not urls:
            raise ValueError("EnvClient needs at least one server URL")
        timeout = httpx.Timeout(timeout_s, connect=connect_timeout_s)
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        headers = {"Authorization": f"Bearer {token}"}
        self.servers = [
            _Server(
                u.rstrip("/"),
                httpx.AsyncClient(base_url=u.rstrip("/"), timeout=timeout, limits=limits, headers=headers),
            )
            for u in urls
        ]
        self.retries, self.backoff_s, self.down_for_s = retries, backoff_s, down_for_s
        self._rr = itertools.count()

    def move(self, old_url: str, new_url: str) -> bool:
        """The server at `old_url` serves at `new_url` now (its supervisor restarted it on another
        port): new sessions and health checks go there; sessions on it were lost with the old process.
        False when no server of this client is at `old_url`."""
        old_url, new_url = old_url.rstrip("/"), new_url.rstrip("/")
        for s in self.servers:
            if s.url == old_url:
                s.url, s.http.base_url, s.down_until = new_url, httpx.URL(new_url), 0.0
                return True
        return False

    async def __aenter__(self) -> EnvClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await asyncio.gather(*(s.http.aclose() for s in self.servers))

    # ---------------------------------------------------------------- plumbing
    @staticmethod
    def _raise_for(resp: httpx.Response) -> dict:
        if resp.status_code < 400:
            return resp.json()
        try:
            err = resp.json().get("error", {})
        except ValueError:
            err = {}
        raise RequestRejected(resp.status_code, err.get("code", "http_error"), err.get("message", resp.text[:500]))

    def _order(self) -> list[_Server]:
        now = time.monotonic()
        up = [s for s in self.servers if s.down_until <= now] or list(self.servers)
        offset = next(self._rr)
        rotated = up[offset % len(up) :] + up[: offset % len(up)]
        return sorted(rotated, key=lambda s: s.sessions)  # stable: round-robin among equals

    async def _sleep(self, attempt: int) -> None:
        await asyncio.sleep(self.backoff_s * (2**attempt) * (0.5 + random.random()))

    async def request_any(self, method: str, path: str, body: Any = None) -> tuple[_Server, dict]:
        """Send to the best server, failing over to others; for requests not tied to a session."""
        last: Exception | None = None
        for attempt in range(self.retries + 1):
            for server in self._order():
                try:
                    resp = await server.http.request(method, path, json=body)
                except _CONNECTION_ERRORS as exc:
                    server.down_until = time.monotonic() + self.down_for_s
                    last = exc
                    continue
                if resp.status_code == 429 or resp.status_code >= 500:
                    last = RequestRejected(resp.status_code, "busy", resp.text[:300])
                    continue
                return server, self._raise_for(resp)
            await self._sleep(attempt)
        raise ServerUnavailable(
            f"no server accepted {method} {path} after {self.retries + 1} rounds over "
            f"{len(self.servers)} server(s): {last}"
        )

    async def _session_request(self, session: RemoteSession, method: str, path: str, body: Any) -> dict:
        server = session.server
        try:
            resp = await server.http.request(method, path, json=body)
        except _CONNECTION_ERRORS as exc:
            server.down_until = time.monotonic() + self.down_for_s
            raise SessionLost(
                f"server {server.url} is unreachable ({type(exc).__name__}); session {session.session_id} is lost",
                session.session_id,
                server.url,
            ) from exc
        if resp.status_code == 404 and "session_not_found" in resp.text:
            raise SessionLost(
                f"server {server.url} no longer has session {session.session_id} (restarted, or the session expired)",
                session.session_id,
                server.url,
            )
        if resp.status_code >= 500:
            raise SessionLost(
                f"server {server.url} failed with HTTP {resp.status_code}", session.session_id, server.url
            )
        return self._raise_for(resp)

    # ---------------------------------------------------------------- API
    async def create_session(self, task_id: str, seed: int | None = None, ttl_s: float | None = None) -> RemoteSession:
        body = {
            "task_id": task_id,
            **({"seed": seed} if seed is not None else {}),
            **({"ttl_s": ttl_s} if ttl_s is not None else {}),
        }
        server, data = await self.request_any("POST", "/sessions", body)
        server.sessions += 1
        return RemoteSession(
            self, server, data["session_id"], data["task_id"], data["instruction"], data["tools"], data
        )

    async def health(self) -> list[dict]:
        """/health of every server (an `error` entry for the unreachable ones)."""

        async def one(s: _Server) -> dict:
            try:
                return {"url": s.url, **(await s.http.get("/health")).json()}
            except (httpx.HTTPError, ValueError) as exc:
                return {"url": s.url, "error": f"{type(exc).__name__}: {exc}"}

        return list(await asyncio.gather(*(one(s) for s in self.servers)))

    async def metrics(self) -> dict[str, str]:
        """The /metrics exposition of every server that answers it, by URL (an RL run's profile reads
        them at each step: runtime/profile.py)."""

        async def one(s: _Server) -> tuple[str, str] | None:
            try:
                resp = await s.http.get("/metrics")
            except httpx.HTTPError:
                return None
            return (s.url, resp.text) if resp.status_code == 200 else None

        got = await asyncio.gather(*(one(s) for s in self.servers))
        return dict(x for x in got if x is not None)

    async def list_tasks(self) -> dict:
        return (await self.request_any("GET", "/tasks"))[1]
