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
does not speak it); an `Origin` other than the server's own host is refused (403: a browser page must
not drive a local server through DNS rebinding). The bearer token is checked by `server.py` first,
as on every route. Transport errors carry a JSON-RPC error body.
"""

from __future__ import annotations

import json
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


def _refused(request: Request) -> Response | None:
    """403 for a foreign Origin, 400 for a protocol version this server does not speak."""
    origin = request.headers.get("origin")
    if origin is not None and urlsplit(origin).netloc.lower() != request.headers.get("host", "").lower():
        return _error(403, f"Origin {origin!r:.120} is not this server's; /mcp answers requests from its own host")
    version = request.headers.get(VERSION_HEADER)
    if version is not None and version not in mcp.PROTOCOL_VERSIONS:
        accepted = ", ".join(mcp.PROTOCOL_VERSIONS)
        return _error(400, f"MCP-Protocol-Version {version!r:.40} is not supported; accepted: {accepted}")
    return None


async def post(request: Request, manager: SessionManager, sessions: mcp.McpSessions) -> Response:
    if (refused := _refused(request)) is not None:
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


async def delete(request: Request, sessions: mcp.McpSessions) -> Response:
    if (refused := _refused(request)) is not None:
        return refused
    mcp_id = request.headers.get(SESSION_HEADER)
    if mcp_id is None:
        return _error(400, "DELETE /mcp needs the Mcp-Session-Id header of the MCP session to end")
    if not await sessions.end(mcp_id):
        return _error(404, f"no MCP session {mcp_id!r:.80} (ended, or never opened)", code=mcp.SESSION_NOT_FOUND)
    return reply(None, 204)


def get() -> Response:
    return _error(405, "GET /mcp: this server opens no server-to-client stream; POST requests", Allow="POST, DELETE")
