"""MCP JSON-RPC 2.0 on `POST /mcp` and `{"type": "mcp"}` frames on `/ws`: two dialects, one dispatcher.

**The Model Context Protocol** (revisions 2024-11-05 to 2025-11-25), as the official `mcp` SDK's
client speaks it: a request without an `Mcp-Session-Id` header whose method is `initialize` opens an
MCP session bound to one environment session (`McpSessions`); every later request carries the
header (`mcp_http.py` is the streamable-HTTP transport: headers, status codes, JSON or SSE bodies).

    initialize              {protocolVersion, capabilities, clientInfo} -> {protocolVersion (the
                            client's when supported, else the newest here), capabilities: {tools},
                            serverInfo, instructions (the task's), _meta: {session_id, task_id, ...}}
    notifications/*         accepted, no answer (HTTP 202)
    ping                    -> {}
    tools/list              -> {"tools": [{name, description, inputSchema, annotations}]}, the session's
    tools/call              {name, arguments} -> {content: [{type: "text", text}], structuredContent, isError}
    composer_jax/grade      -> the task's tests on a copy of the workspace: POST /sessions/{id}/grade's body

Which environment session: initialize reads `task_id`, `seed`, `episode_id`, `ttl_s` (a new session,
closed when the MCP session ends) or `session_id` (attach to an open one, left open) from the
endpoint's query string (`/mcp?task_id=fix-add`: an SDK client cannot add initialize params) or
from initialize's params; none of them: a task picked by the seed, as OpenEnv's bare reset.

**OpenEnv's surface** (`HTTPEnvServer`; OpenEnv 0.10's `MCPToolClient` uses all four), for a request
with no `Mcp-Session-Id` header, so OpenEnv clients, which never initialize, work unchanged:

    tools/list                  -> {"tools": [{"name", "description", "inputSchema"}]}   no session needed
    tools/call                  {"name", "arguments", "session_id"?} -> CallToolResult
                                (`openenv_protocol.call_tool_result`); on a socket, its own session
    openenv/session/create      {"task_id"?, "seed"?, "episode_id"?, "ttl_s"?} -> {"session_id", ...};
                                without task_id the task is picked by the seed, as a bare reset
    openenv/session/close       {"session_id"} -> {"session_id", "closed": true}
    (ping and composer_jax/grade {"session_id"} too)

A tool call the model got wrong (unknown tool, bad arguments) or that failed (missing file) is a
result with `isError` (`is_error`) true: the agent sees it, the caller's loop goes on. JSON-RPC errors
are for the caller's mistakes: a malformed request (-32600), unknown method (-32601), bad params or
unknown session (-32602), a server that cannot open a session (-32000).

Why not the SDK's (or fastmcp's) server: its streamable-HTTP session manager keeps sessions of its
own (a task and memory streams per session, ids it mints) and validates every message against the
standard methods, so OpenEnv's sessionless `session_id`-in-params calls and `openenv/session/*`
would need a second endpoint in front of it; this server's sessions, TTLs, capacity and bearer
auth are `SessionManager`'s and FastAPI's. The protocol surface a tool server needs is the
handful of methods above; the SDK's own client and pydantic types test it (tests/env/server/test_mcp_sdk.py).
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass
from typing import Any

from composer_jax.env.api import protocol
from composer_jax.env.api.errors import CapacityError, SessionBusy, SessionNotFound, TaskError, TaskNotRunnable
from composer_jax.env.server import openenv_protocol as op
from composer_jax.env.server.session import Session, SessionManager

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
SERVER_ERROR = -32000
SESSION_NOT_FOUND = -32001  # an unknown or ended Mcp-Session-Id (HTTP 404)
GRADE = "composer_jax/grade"
METHODS = ("tools/list", "tools/call", "openenv/session/create", "openenv/session/close", "ping", GRADE)
MCP_METHODS = ("initialize", "ping", "tools/list", "tools/call", GRADE)
# MCP revisions this server speaks, oldest first; a client asking for another gets the newest.
PROTOCOL_VERSIONS = ("2024-11-05", "2025-03-26", "2025-06-18", "2025-11-25")
SESSION_KEYS = ("task_id", "seed", "episode_id", "ttl_s", "session_id")
SERVER_INFO = {"name": op.METADATA["name"], "title": "composer_jax environment server", "version": "1.0"}
_READ_ONLY = frozenset({"read_file", "list_dir", "grep", "semantic_search", *protocol.WEB_TOOL_NAMES})


class RpcError(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def response(request_id: Any, result: Any = None, error: RpcError | None = None) -> dict:
    """A JSON-RPC 2.0 response: `result` or `error`, never both."""
    if error is not None:
        return {"jsonrpc": "2.0", "id": request_id, "error": {"code": error.code, "message": error.message}}
    return {"jsonrpc": "2.0", "id": request_id, "result": result}


def message_kind(message: Any) -> str:
    """ "request", "notification" (a method, no id: never answered), "response" (the client
    answering a server request: this server sends none, so it is dropped) or "invalid"."""
    if not isinstance(message, dict) or message.get("jsonrpc") != "2.0":
        return "invalid"
    if isinstance(message.get("method"), str):
        return "request" if "id" in message else "notification"
    return "response" if "id" in message and ("result" in message or "error" in message) else "invalid"


def request_id_of(message: Any) -> Any:
    request_id = message.get("id") if isinstance(message, dict) else None
    return request_id if isinstance(request_id, (str, int)) and not isinstance(request_id, bool) else None


def call_result(outcome: dict) -> dict:
    """A call's outcome as MCP's CallToolResult: the tool's result (or {"error": message}) as
    structuredContent and, as the spec asks of structured results, the same as JSON text."""
    body = outcome["result"] if outcome["ok"] else {"error": outcome["error"]}
    text = json.dumps(body, ensure_ascii=False)
    return {"content": [{"type": "text", "text": text}], "structuredContent": body, "isError": not outcome["ok"]}


def mcp_tools(names: tuple[str, ...]) -> list[dict]:
    """MCP tool specs with annotations: which tools only read, and that only the web tools reach
    outside the sandbox (MCP's openWorldHint defaults to true)."""
    return [
        {
            **t,
            "annotations": {
                "readOnlyHint": t["name"] in _READ_ONLY,
                "openWorldHint": t["name"] in protocol.WEB_TOOL_NAMES,
            },
        }
        for t in op.mcp_tools("inputSchema", names)
    ]


async def call_one(
    manager: SessionManager, session: Session, name: Any, arguments: Any, shape=op.call_tool_result
) -> tuple[dict | None, Any]:
    """Run one MCP-style call in `session` as a step: (`shape`(outcome), None), or (None, (error
    type, message)) for a call that never reached a tool (unknown tool, bad arguments)."""
    if session.done:
        return None, (op.EXECUTION_ERROR, op.EPISODE_DONE)
    session.step_count += 1
    try:
        call = protocol.parse_call(name, arguments if arguments is not None else {}, offered=session.tool_names)
    except protocol.ToolArgumentError as exc:
        return None, op.bad_call_error(exc)
    [outcome] = await manager.call_tools(session.session_id, [call])
    return shape(outcome), None


@dataclass
class McpSession:
    """One MCP session: the environment session it drives, and whether it closes that one when it ends."""

    mcp_id: str
    env_id: str
    owned: bool
    protocol_version: str


class McpSessions:
    """The MCP sessions of one server, by Mcp-Session-Id. An entry lives as long as both it and its
    environment session do: a session closed elsewhere (DELETE /sessions/ID, its TTL) makes the MCP
    session unknown (HTTP 404, after which the SDK's client starts another)."""

    def __init__(self, manager: SessionManager, max_sessions: int | None = None):
        self.manager = manager
        self.max_sessions = max_sessions or 4 * manager.max_sessions
        self._by_id: dict[str, McpSession] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def get(self, mcp_id: str) -> McpSession | None:
        entry = self._by_id.get(mcp_id)
        if entry is not None and entry.env_id not in self.manager:
            del self._by_id[mcp_id]
            return None
        return entry

    async def open(self, args: dict, protocol_version: str) -> tuple[McpSession, Session]:
        """A new MCP session on a new environment session, or attached to `args["session_id"]`."""
        self._by_id = {k: v for k, v in self._by_id.items() if v.env_id in self.manager}
        if len(self._by_id) >= self.max_sessions:
            raise RpcError(SERVER_ERROR, f"server is at its limit of {self.max_sessions} MCP sessions; end one")
        if "session_id" in args:
            if len(args) > 1:
                other = sorted(set(args) - {"session_id"})
                raise RpcError(INVALID_PARAMS, f"session_id attaches to an open session; drop {', '.join(other)}")
            session, owned = _session(self.manager, args["session_id"]), False
        else:
            session, owned = await _create(self.manager, args), True
        entry = McpSession(secrets.token_urlsafe(24), session.session_id, owned, protocol_version)
        self._by_id[entry.mcp_id] = entry
        return entry, session

    async def end(self, mcp_id: str) -> bool:
        """End an MCP session (closing its environment session if it opened it); False if unknown."""
        entry = self.get(mcp_id)
        if entry is None:
            return False
        del self._by_id[mcp_id]
        if entry.owned:
            try:
                await self.manager.close(entry.env_id, reason="mcp")
            except SessionNotFound:
                pass
        return True


def session_args(query: dict[str, str], params: dict) -> dict:
    """initialize's choice of environment session, from the query string and/or params (the same
    key in both must agree); query strings are text, so seed and ttl_s are converted here."""
    args: dict[str, Any] = {k: params[k] for k in SESSION_KEYS if params.get(k) is not None}
    for key in SESSION_KEYS:
        if key not in query:
            continue
        value: Any = query[key]
        try:
            value = int(value) if key == "seed" else float(value) if key == "ttl_s" else value
        except ValueError:
            kind = "an integer" if key == "seed" else "a number of seconds"
            raise RpcError(
                INVALID_PARAMS, f"{key}={query[key]!r:.80} in the /mcp query string must be {kind}"
            ) from None
        if key in args and args[key] != value:
            raise RpcError(
                INVALID_PARAMS, f"{key} is {value!r:.80} in the query string but {args[key]!r:.80} in params"
            )
        args[key] = value
    return args


def negotiate(params: dict) -> str:
    asked = params.get("protocolVersion")
    if not isinstance(asked, str):
        raise RpcError(INVALID_PARAMS, f"initialize needs params.protocolVersion, e.g. {PROTOCOL_VERSIONS[-1]!r}")
    return asked if asked in PROTOCOL_VERSIONS else PROTOCOL_VERSIONS[-1]


async def initialize(sessions: McpSessions, request: Any, query: dict[str, str]) -> tuple[dict, McpSession | None]:
    """Answer an `initialize` request: (response, the MCP session it opened, or None on an error)."""
    request_id = request_id_of(request)
    try:
        params = request.get("params", {})
        if not isinstance(params, dict):
            raise RpcError(INVALID_PARAMS, f"params must be an object, got {type(params).__name__}")
        version = negotiate(params)
        entry, session = await sessions.open(session_args(query, params), version)
    except RpcError as exc:
        return response(request_id, error=exc), None
    facts = op.reset_observation(session)["metadata"]
    result = {
        "protocolVersion": version,
        "capabilities": {"tools": {"listChanged": False}},
        "serverInfo": SERVER_INFO,
        "instructions": session.task.instruction,
        "_meta": {k: v for k, v in facts.items() if k != "instruction"},
    }
    return response(request_id, result), entry


async def handle(manager: SessionManager, request: Any, bound: str | None = None, *, standard: bool = False) -> dict:
    """Answer one JSON-RPC request. `bound`: the environment session of the WebSocket it came on, or
    of its MCP session (`standard`: MCP's result shapes, and the bound session wins over params')."""
    request_id = request_id_of(request)
    try:
        if isinstance(request, list):
            raise RpcError(INVALID_REQUEST, "a batch (JSON array) is not accepted; send one message per request")
        valid = isinstance(request, dict) and request.get("jsonrpc") == "2.0"
        if not valid or not isinstance(request.get("method"), str):
            raise RpcError(INVALID_REQUEST, 'a JSON-RPC 2.0 request needs "jsonrpc": "2.0" and a string "method"')
        params = request.get("params", {})
        if not isinstance(params, dict):
            raise RpcError(INVALID_PARAMS, f"params must be an object, got {type(params).__name__}")
        session_id = bound if standard else params.get("session_id") or bound
        return response(request_id, await _dispatch(manager, request["method"], params, session_id, standard))
    except RpcError as exc:
        return response(request_id, error=exc)


async def _dispatch(manager: SessionManager, method: str, params: dict, session_id: Any, standard: bool) -> Any:
    if method == "ping":
        return {}
    if method == "tools/list":  # a session's own tools; without one, those every session gets
        names = _session(manager, session_id).tool_names if session_id is not None else manager.offered_tools()
        return {"tools": mcp_tools(names) if standard else op.mcp_tools("inputSchema", names)}
    if method == "tools/call":
        return await _call(manager, params, session_id, call_result if standard else op.call_tool_result)
    if method == GRADE:
        try:
            return {
                "session_id": session_id,
                **(await manager.grade(_session(manager, session_id, GRADE).session_id)).to_dict(),
            }
        except SessionBusy as exc:
            raise RpcError(INVALID_REQUEST, str(exc)) from None
        except SessionNotFound as exc:
            raise RpcError(INVALID_PARAMS, str(exc)) from None
    if method == "openenv/session/create" and not standard:
        session = await _create(manager, params)
        return {k: v for k, v in op.reset_observation(session).items() if k not in ("tools", "metadata")}
    if method == "openenv/session/close" and not standard:
        session_id = params.get("session_id")  # never the socket's own: that one closes with the socket
        if not isinstance(session_id, str):
            raise RpcError(INVALID_PARAMS, f"openenv/session/close needs params.session_id, got {session_id!r:.80}")
        try:
            await manager.close(session_id, reason="mcp")
        except SessionNotFound as exc:
            raise RpcError(INVALID_PARAMS, str(exc)) from None
        return {"session_id": session_id, "closed": True}
    accepted = MCP_METHODS if standard else METHODS
    raise RpcError(METHOD_NOT_FOUND, f"unknown method {method!r}; accepted: {', '.join(accepted)}")


async def _call(manager: SessionManager, params: dict, session_id: Any, shape) -> dict:
    name = params.get("name")
    if not isinstance(name, str) or not name:
        raise RpcError(INVALID_PARAMS, f"tools/call needs params.name; accepted: {', '.join(protocol.TOOL_NAMES)}")
    session = _session(manager, session_id)
    try:
        result, error = await call_one(manager, session, name, params.get("arguments", {}), shape)
    except SessionBusy as exc:
        raise RpcError(INVALID_REQUEST, str(exc)) from None
    except SessionNotFound as exc:
        raise RpcError(INVALID_PARAMS, str(exc)) from None
    if error is not None:  # the agent still gets a result it can read
        result = shape({"ok": False, "error": error[1]})
    assert result is not None
    return result


async def _create(manager: SessionManager, args: dict) -> Session:
    try:
        return await manager.create(
            args.get("task_id"), args.get("seed"), args.get("ttl_s"), episode_id=args.get("episode_id")
        )
    except CapacityError as exc:
        raise RpcError(SERVER_ERROR, str(exc)) from None
    except (TaskError, TaskNotRunnable) as exc:
        raise RpcError(INVALID_PARAMS, str(exc)) from None


def _session(manager: SessionManager, session_id: Any, method: str = "tools/call") -> Session:
    if session_id is None:
        raise RpcError(
            INVALID_PARAMS,
            f"{method} needs params.session_id (from openenv/session/create), a reset on this socket, "
            "or an MCP session (initialize)",
        )
    try:
        return manager.get(session_id)
    except SessionNotFound as exc:
        raise RpcError(INVALID_PARAMS, str(exc)) from None
