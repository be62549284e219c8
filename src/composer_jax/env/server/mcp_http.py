"""MCP's streamable-HTTP transport on `/mcp` (revision 2025-06-18 and later; `mcp.py` answers the messages).

    POST    one JSON-RPC message. A request is answered in the body: JSON when the client accepts
            application/json (the SDK's client sends `Accept: application/json, text/event-stream`),
            else one SSE `message` event; 406 when it accepts neither. A notification or a client's
            response: 202, no body. initialize's answer carries `Mcp-Session-Id`; a request with an
            unknown or ended one gets 404 (the SDK's client then reports "Session terminated").
    DELETE  `Mcp-Session-Id`: ends the MCP session (204), closing the environment session it opened.
    GET     405: this server sends nothing unprompted (no server-to-client stream).

A POST without `Mcp-Session-Id` that is not `initialize` is OpenEnv's sessionless surface (mcp.py),
so OpenEnv's clients keep working. `MCP-Protocol-Version` is checked when sent (400 if this server
does not speak it). Every request's `Host`, and its `Origin` when sent, must name this server
(`HostPolicy`; 403 otherwise): the DNS-rebinding defence the MCP specification asks of a local
server. The bearer token is checked by `app.py` first, as on every route. Transport errors carry a
JSON-RPC error body.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from fastapi import Request
from fastapi.responses import Response

from composer_jax.env.server import mcp
from composer_jax.env.server.session import SessionManager

try:
    import orjson

    _HAVE_ORJSON = True
except ImportError:  # pragma: no cover - orjson is in locks/env.lock
    _HAVE_ORJSON = False

SESSION_HEADER = "mcp-session-id"
VERSION_HEADER = "mcp-protocol-version"
JSON = "application/json"
SSE = "text/event-stream"


def _encode(body: dict) -> bytes:
    if _HAVE_ORJSON:
        try:
            return orjson.dumps(body)
        except (orjson.JSONEncodeError, TypeError):
            pass  # e.g. a lone surrogate from an undecodable file name: json escapes it
    return json.dumps(body).encode()


def response_format(accept: str | None) -> str | None:
    """ "json", "sse" or None (406) for a request's Accept header; no header accepts anything."""
    if not accept:
        return "json"
    kinds = {part.split(";", 1)[0].strip().lower() for part in accept.split(",")}
    if kinds & {JSON, "application/*", "*/*"}:
        return "json"
    return "sse" if kinds & {SSE, "text/*"} else None


def reply(body: dict | None, status: int = 200, fmt: str = "json", headers: dict[str, str] | None = None) -> Response:
    if body is None:
        return Response(status_code=status, headers=headers)
    if fmt == "sse":
        return Response(b"event: message\ndata: " + _encode(body) + b"\n\n", status, headers, media_type=SSE)
    return Response(_encode(body), status, headers, media_type=JSON)


def _error(status: int, message: str, request_id=None, code: int = mcp.INVALID_REQUEST, **headers: str) -> Response:
    return reply(mcp.response(request_id, error=mcp.RpcError(code, message)), status, headers=headers or None)


LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
_DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}


def _canonical(name: str) -> str:
    """A host name compared as written (lower case, no trailing dot); an IP literal in its one form."""
    name = name.lower().rstrip(".")
    try:
        return str(ipaddress.ip_address(name))
    except ValueError:
        return name


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _host_and_port(netloc: str, scheme: str) -> tuple[str, int] | None:
    """("name", port) of a Host header or an Origin's netloc, the scheme's port when none is written;
    None when it is not one."""
    try:
        parts = urlsplit("//" + netloc)
        port = parts.port if parts.port is not None else _DEFAULT_PORTS.get(scheme)
    except ValueError:  # a port that is not a number, an unbalanced [
        return None
    if not parts.hostname or port is None or parts.username is not None:
        return None
    return _canonical(parts.hostname), port


@dataclass(frozen=True)
class HostPolicy:
    """The names a request to /mcp may address this server by, in its `Host` and its `Origin`.

    A browser page on evil.example whose name the attacker then rebinds to 127.0.0.1 reaches a local
    server with `Host: evil.example:PORT` and a matching `Origin`, so comparing Origin with Host alone
    admits it (DNS rebinding); a Host that must be one of the server's own names refuses it. An IP
    literal cannot be rebound, so a server bound to a wildcard address (0.0.0.0, ::) accepts any.
    The defaults are a loopback server's: localhost, 127.0.0.1 and ::1."""

    names: frozenset[str] = LOOPBACK_NAMES
    any_address: bool = False

    @classmethod
    def for_bind(cls, bound: str, names: Iterable[str] = ()) -> HostPolicy:
        """The policy of a server listening on `bound` (an IP address) that clients also reach as
        `names` (`--host` when it is a name, and each `--allowed-host`)."""
        address = ipaddress.ip_address(bound.split("%")[0])
        allowed = {str(address), *(_canonical(n) for n in names)}
        if address.is_loopback or address.is_unspecified:
            allowed |= LOOPBACK_NAMES
        return cls(frozenset(allowed), address.is_unspecified)

    def allows(self, name: str) -> bool:
        name = _canonical(name)
        return name in self.names or (self.any_address and _is_ip(name))

    def accepted(self) -> str:
        """The accepted names, for an error message."""
        return ", ".join(sorted(self.names)) + (", or any IP address of this machine" if self.any_address else "")


LOOPBACK_HOSTS = HostPolicy()  # a server bound to 127.0.0.1: create_app's default


def _foreign(request: Request, hosts: HostPolicy) -> str | None:
    """Why the request's Host or Origin does not name this server (None when both do)."""
    host = request.headers.get("host", "")
    own = _host_and_port(host, request.url.scheme)
    if own is None or not hosts.allows(own[0]):
        return (
            f"Host {host!r:.120} is not one of this server's names ({hosts.accepted()}); "
            "a server reached by another name is started with --allowed-host NAME"
        )
    origin = request.headers.get("origin")
    if origin is None:  # not a browser: the SDK's clients and OpenEnv's send none
        return None
    parts = urlsplit(origin)
    if _host_and_port(parts.netloc, parts.scheme) != own:
        return f"Origin {origin!r:.120} is not this server's; /mcp answers pages of its own origin only"
    return None


def _refused(request: Request, hosts: HostPolicy) -> Response | None:
    """403 for a foreign Host or Origin, 400 for a protocol version this server does not speak."""
    if (why := _foreign(request, hosts)) is not None:
        return _error(403, why)
    version = request.headers.get(VERSION_HEADER)
    if version is not None and version not in mcp.PROTOCOL_VERSIONS:
        accepted = ", ".join(mcp.PROTOCOL_VERSIONS)
        return _error(400, f"MCP-Protocol-Version {version!r:.40} is not supported; accepted: {accepted}")
    return None


async def post(request: Request, manager: SessionManager, sessions: mcp.McpSessions, hosts: HostPolicy) -> Response:
    if (refused := _refused(request, hosts)) is not None:
        return refused
    fmt = response_format(request.headers.get("accept"))
    if fmt is None:
        return _error(406, f"Accept must include {JSON} or {SSE}, got {request.headers.get('accept')!r:.120}")
    try:
        message = json.loads(await request.body())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        return reply(
            mcp.response(None, error=mcp.RpcError(mcp.PARSE_ERROR, f"request body is not JSON: {exc}")), fmt=fmt
        )
    kind = mcp.message_kind(message)
    mcp_id = request.headers.get(SESSION_HEADER)
    entry = sessions.get(mcp_id) if mcp_id is not None else None
    if mcp_id is not None and entry is None:
        message_id = mcp.request_id_of(message)
        return _error(
            404,
            f"no MCP session {mcp_id!r:.80} (ended, or never opened): initialize another",
            message_id,
            mcp.SESSION_NOT_FOUND,
        )
    if kind in ("notification", "response"):
        return reply(None, 202)
    if kind == "request" and message["method"] == "initialize":
        if entry is not None:
            why = "this MCP session is initialized; an initialize without Mcp-Session-Id opens another"
            return reply(
                mcp.response(mcp.request_id_of(message), error=mcp.RpcError(mcp.INVALID_REQUEST, why)), fmt=fmt
            )
        body, opened = await mcp.initialize(sessions, message, dict(request.query_params))
        return reply(body, fmt=fmt, headers={"Mcp-Session-Id": opened.mcp_id} if opened is not None else None)
    if entry is None:
        return reply(await mcp.handle(manager, message), fmt=fmt)
    return reply(await mcp.handle(manager, message, entry.env_id, standard=True), fmt=fmt)


async def delete(request: Request, sessions: mcp.McpSessions, hosts: HostPolicy) -> Response:
    if (refused := _refused(request, hosts)) is not None:
        return refused
    mcp_id = request.headers.get(SESSION_HEADER)
    if mcp_id is None:
        return _error(400, "DELETE /mcp needs the Mcp-Session-Id header of the MCP session to end")
    if not await sessions.end(mcp_id):
        return _error(404, f"no MCP session {mcp_id!r:.80} (ended, or never opened)", code=mcp.SESSION_NOT_FOUND)
    return reply(None, 204)


def get() -> Response:
    return _error(405, "GET /mcp: this server opens no server-to-client stream; POST requests", Allow="POST, DELETE")
