"""MCP JSON-RPC 2.0 as OpenEnv serves it: `POST /mcp` and `{"type": "mcp"}` frames on `/ws`.

Methods (OpenEnv's `HTTPEnvServer` surface; OpenEnv 0.10's `MCPToolClient` uses all four):

    tools/list                  -> {"tools": [{"name", "description", "inputSchema"}]}   no session needed
    tools/call                  {"name", "arguments", "session_id"?} -> CallToolResult
                                (`openenv_protocol.call_tool_result`); on a socket, its own session
    openenv/session/create      {"task_id"?, "seed"?, "episode_id"?, "ttl_s"?} -> {"session_id", ...};
                                without task_id the task is picked by the seed, as a bare reset
    openenv/session/close       {"session_id"} -> {"session_id", "closed": true}

A tool call the model got wrong (unknown tool, bad arguments) or that failed (missing file) is a
result with `is_error: true`: the agent sees it, the caller's loop goes on. JSON-RPC errors are
for the caller's mistakes: a malformed request (-32600), unknown method (-32601), bad params or
unknown session (-32602), a server that cannot open a session (-32000). Every answer is HTTP 200.
"""

from __future__ import annotations

from typing import Any

from composer_jax.env import openenv_protocol as op
from composer_jax.env import protocol
from composer_jax.env.errors import CapacityError, SessionBusy, SessionNotFound, TaskError, TaskNotRunnable
from composer_jax.env.session import Session, SessionManager

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602
SERVER_ERROR = -32000
METHODS = ("tools/list", "tools/call", "openenv/session/create", "openenv/session/close")


class RpcError(Exception):
    def __init__(self, code: int, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def response(request_id: Any, result: Any = None, error: RpcError | None = None) -> dict:
    """A JSON-RPC 2.0 response: `result` or `error`, never both."""
    if error is not None:
        return {"jsonrpc": "2.0", "id": request_id, "error": {"code": error.code, "message": error.message}}
    return {"jsonrpc": "2.0", "id": request_id, "result": result}


async def call_one(manager: SessionManager, session: Session, name: Any, arguments: Any) -> tuple[dict | None, Any]:
    """Run one MCP-style call in `session` as a step: (CallToolResult, None), or (None, (error
    type, message)) for a call that never reached a tool (unknown tool, bad arguments)."""
    if session.done:
        return None, (op.EXECUTION_ERROR, op.EPISODE_DONE)
    session.step_count += 1
    try:
        call = protocol.parse_call(name, arguments if arguments is not None else {}, offered=session.tool_names)
    except protocol.ToolArgumentError as exc:
        return None, op.bad_call_error(exc)
    [outcome] = await manager.call_tools(session.session_id, [call])
    return op.call_tool_result(outcome), None


async def handle(manager: SessionManager, request: Any, socket_session: str | None = None) -> dict:
    """Answer one JSON-RPC request. `socket_session` is the session of the WebSocket it came on."""
    request_id = request.get("id") if isinstance(request, dict) else None
    if not isinstance(request_id, (str, int)) or isinstance(request_id, bool):
        request_id = None
    try:
        valid = isinstance(request, dict) and request.get("jsonrpc") == "2.0"
        if not valid or not isinstance(request.get("method"), str):
            raise RpcError(INVALID_REQUEST, 'a JSON-RPC 2.0 request needs "jsonrpc": "2.0" and a string "method"')
        params = request.get("params", {})
        if not isinstance(params, dict):
            raise RpcError(INVALID_PARAMS, f"params must be an object, got {type(params).__name__}")
        return response(request_id, await _dispatch(manager, request["method"], params, socket_session))
    except RpcError as exc:
        return response(request_id, error=exc)


async def _dispatch(manager: SessionManager, method: str, params: dict, socket_session: str | None) -> Any:
    if method == "tools/list":  # a session's own tools; without one, those every session gets
        session_id = params.get("session_id") or socket_session
        names = _session(manager, session_id).tool_names if session_id is not None else manager.offered_tools()
        return {"tools": op.mcp_tools("inputSchema", names)}
    if method == "tools/call":
        name = params.get("name")
        if not isinstance(name, str) or not name:
            raise RpcError(INVALID_PARAMS, f"tools/call needs params.name; accepted: {', '.join(protocol.TOOL_NAMES)}")
        session = _session(manager, params.get("session_id") or socket_session)
        try:
            result, error = await call_one(manager, session, name, params.get("arguments", {}))
        except SessionBusy as exc:
            raise RpcError(INVALID_REQUEST, str(exc)) from None
        except SessionNotFound as exc:
            raise RpcError(INVALID_PARAMS, str(exc)) from None
        if error is not None:  # the agent still gets a result it can read
            result = op.call_tool_result({"ok": False, "error": error[1]})
        return result
    if method == "openenv/session/create":
        try:
            session = await manager.create(
                params.get("task_id"), params.get("seed"), params.get("ttl_s"), episode_id=params.get("episode_id")
            )
        except CapacityError as exc:
            raise RpcError(SERVER_ERROR, str(exc)) from None
        except (TaskError, TaskNotRunnable) as exc:
            raise RpcError(INVALID_PARAMS, str(exc)) from None
        return {k: v for k, v in op.reset_observation(session).items() if k not in ("tools", "metadata")}
    if method == "openenv/session/close":
        session_id = params.get("session_id")
        if not isinstance(session_id, str):
            raise RpcError(INVALID_PARAMS, f"openenv/session/close needs params.session_id, got {session_id!r:.80}")
        try:
            await manager.close(session_id, reason="mcp")
        except SessionNotFound as exc:
            raise RpcError(INVALID_PARAMS, str(exc)) from None
        return {"session_id": session_id, "closed": True}
    raise RpcError(METHOD_NOT_FOUND, f"unknown method {method!r}; accepted: {', '.join(METHODS)}")


def _session(manager: SessionManager, session_id: Any) -> Session:
    if session_id is None:
        raise RpcError(
            INVALID_PARAMS,
            "tools/call needs params.session_id (from openenv/session/create), or a reset on this socket",
        )
    try:
        return manager.get(session_id)
    except SessionNotFound as exc:
        raise RpcError(INVALID_PARAMS, str(exc)) from None
