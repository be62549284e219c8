"""The environment server's HTTP/JSON API (FastAPI; OpenAPI schema at /openapi.json).

Endpoints (all but /health need `Authorization: Bearer TOKEN`, or the path form: every path is
also served under /t/TOKEN/, for OpenEnv clients and tools that cannot send headers):
    GET    /health                        liveness, capacity, sandbox backend
    GET    /metadata, /schema             OpenEnv's environment description and JSON schemas
    POST   /mcp                           MCP JSON-RPC: MCP's streamable HTTP (initialize, Mcp-Session-Id)
                                          and OpenEnv's sessionless calls (see mcp.py, mcp_http.py)
    DELETE /mcp                           end an MCP session (GET /mcp: 405, no server stream)
    GET    /metrics                       Prometheus text format (prometheus_client; metrics.py)
    GET    /tasks                         task ids, local runnability, generated families
    GET    /tools                         tool schemas (OpenAI function-calling format) this server offers
    POST   /sessions                      {task_id, seed?, ttl_s?} -> session id, instruction, tools
    GET    /sessions/{id}                 session state
    POST   /sessions/{id}/tools           {calls: [{id?, name, arguments}]} -> results, run in parallel
    POST   /sessions/{id}/grade           run the task's tests on a copy -> reward, tests, diff
    DELETE /sessions/{id}                 close (kills every process of the session)
    WS     /ws                            OpenEnv session (reset/step/state/mcp; see openenv_ws.py)
Errors are JSON `{"error": {"code", "message"}}` with a 4xx status naming the bad value.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request, WebSocket
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

try:
    import orjson  # ~10x faster than json for tool results (file contents); optional

    _HAVE_ORJSON = True
except ImportError:  # pragma: no cover - orjson is in locks/env.lock
    _HAVE_ORJSON = False

from composer_jax.env.api import protocol
from composer_jax.env.api.errors import (
    CapacityError,
    SessionBusy,
    SessionNotFound,
    TaskError,
    TaskNotRunnable,
    UnknownTaskError,
)
from composer_jax.env.sandbox.volumes import volume_kind
from composer_jax.env.server import mcp, mcp_http
from composer_jax.env.server import openenv_protocol as op
from composer_jax.env.server.metrics import CONTENT_TYPE, EnvMetrics
from composer_jax.env.server.openenv_ws import serve_openenv_websocket
from composer_jax.env.server.session import SessionManager
from composer_jax.env.tasks.store import MAX_SEED

_log = logging.getLogger("composer_jax.env.server.app")

DEFAULT_MAX_BODY_BYTES = 4 * 2**20
MAX_CALLS_PER_REQUEST = 64


class ApiError(Exception):
    """An error whose status is decided where it is raised (401, 413); other errors are typed and
    mapped by `_ERROR_STATUS`."""

    def __init__(self, status: int, code: str, message: str, headers: dict | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.headers = status, code, message, headers


class ErrorBody(BaseModel):
    code: str
    message: str


class ErrorResponse(BaseModel):
    error: ErrorBody


class CreateSessionRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    task_id: str = Field(min_length=1, max_length=256, description="a task directory name, or gen/<family>")
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED, description="for generated tasks (default 0)")
    episode_id: str | None = Field(default=None, min_length=1, max_length=256, description="the client's name")
    ttl_s: float | None = Field(default=None, gt=0, le=86400, description="idle time before the session is closed")


class CreateSessionResponse(BaseModel):
    session_id: str
    task_id: str
    seed: int
    instruction: str
    tools: list[dict[str, Any]]
    expires_at: float


class ToolCall(BaseModel):
    """One call. Also accepts the OpenAI shape {"id", "type": "function", "function": {"name", "arguments"}}."""

    model_config = ConfigDict(extra="forbid")
    id: str | None = Field(default=None, max_length=256)
    name: str = Field(max_length=128)
    arguments: dict[str, Any] | str = Field(default_factory=dict, description="object, or a JSON string of one")

    @model_validator(mode="before")
    @classmethod
    def _openai_shape(cls, data: Any) -> Any:
        return protocol.unwrap_call(data)


class ToolCallsRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    calls: list[ToolCall] = Field(min_length=1, max_length=MAX_CALLS_PER_REQUEST)


class ToolResult(BaseModel):
    id: str | None
    name: str
    ok: bool
    result: dict[str, Any] | None = None
    error: str | None = None
    duration_s: float


class ToolCallsResponse(BaseModel):
    session_id: str
    results: list[ToolResult]


class GradeResponse(BaseModel):
    session_id: str
    reward: float
    tests: list[dict[str, Any]]
    diff: str
    error: str | None
    exit_code: int | None
    timed_out: bool
    output_tail: str
    duration_s: float
    reward_details: dict[str, Any]
    interpreter: dict[str, Any] = Field(default_factory=dict, description="the sandbox's python3: {python, version}")
    environment: dict[str, Any] = Field(
        default_factory=dict,
        description="the task's built Python environment {key, python, requirements, pytest}, or {}",
    )
    tampering: list[dict[str, Any]] = Field(
        default_factory=list,
        description="levers the change pulls on grading: [{path, line, class, what, code, action}] (read from "
        "its Python), or a forged verdict or reward file [{path, class, action}]; any entry makes the reward 0",
    )
    excluded: list[dict[str, Any]] = Field(
        default_factory=list,
        description="what the grade did not carry from the workspace onto the task's pristine one: "
        "[{path, class}] (symlink, bytecode, binary, large, vcs, cache, startup-hook, conftest, test-config, "
        "test-file, runner-shadow); no penalty",
    )
    cached: bool = Field(
        False,
        description="the verdict of an earlier grade of an equal carried change of this task (env-server "
        "--grade-cache); the tests did not run again",
    )


_ERRORS: dict[int | str, dict[str, Any]] = {
    status: {"model": ErrorResponse} for status in (400, 401, 404, 409, 413, 422, 429)
}
_SESSION_ID = PathParam(description="id returned by POST /sessions", max_length=64)


# Exception type -> (HTTP status, error code, extra headers). Looked up along the raised type's MRO,
# so a subclass listed here (UnknownTaskError) wins over its base (TaskError).
_ERROR_STATUS: dict[type[Exception], tuple[int, str, dict[str, str] | None]] = {
    UnknownTaskError: (404, "bad_task", None),
    TaskError: (400, "bad_task", None),
    TaskNotRunnable: (409, "task_not_runnable", None),
    CapacityError: (429, "at_capacity", {"Retry-After": "1"}),
    SessionNotFound: (404, "session_not_found", None),
    SessionBusy: (409, "session_busy", None),
    protocol.UnknownToolError: (400, "unknown_tool", None),
    protocol.ToolArgumentError: (400, "invalid_arguments", None),
}


def parse_calls(calls: list[ToolCall], offered: tuple[str, ...] | None = None) -> list[tuple[str, dict]]:
    """Validate every call before any runs; ToolArgumentError (a 400) names the first bad one.
    `offered`: the session's tools; a call to another is an unknown tool."""
    return [protocol.parse_call(call.name, call.arguments, f"calls[{i}]", offered) for i, call in enumerate(calls)]


def _tool_calls_response(session_id: str, calls: list[ToolCall], results: list[dict]) -> Response:
    """The ToolCallsResponse body, encoded directly.

    This is the hot path of every rollout step. Building ToolResult models and letting FastAPI
    validate and serialise them again through `response_model` was the largest avoidable cost per
    call (with the async auth check, server CPU per file-tool call fell from ~0.72 to ~0.55 ms);
    the route keeps `response_model=ToolCallsResponse` for the OpenAPI schema.
    """
    body = {
        "session_id": session_id,
        "results": [
            {
                "id": c.id,
                "name": c.name,
                "ok": r["ok"],
                "result": r.get("result"),
                "error": r.get("error"),
                "duration_s": r["duration_s"],
            }
            for c, r in zip(calls, results)
        ],
    }
    if _HAVE_ORJSON:
        try:
            return Response(orjson.dumps(body), media_type="application/json")
        except (orjson.JSONEncodeError, TypeError):
            pass  # e.g. a lone surrogate from an undecodable file name: the previous, pydantic path
    return JSONResponse(
        ToolCallsResponse(
            session_id=session_id, results=[ToolResult(id=c.id, name=c.name, **r) for c, r in zip(calls, results)]
        ).model_dump(mode="json")
    )


def _validation_message(exc: RequestValidationError) -> tuple[str, str]:
    parts = []
    for err in exc.errors()[:5]:
        if err.get("type") == "json_invalid":
            return (
                "malformed_json",
                f"request body is not valid JSON: {err.get('ctx', {}).get('error', err.get('msg'))}",
            )
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
        value = err.get("input")
        shown = "" if isinstance(value, (dict, list)) or value is None else f" (got {str(value)[:60]!r})"
        parts.append(f"{loc}: {err.get('msg')}{shown}")
    return "invalid_request", "; ".join(parts) or "invalid request"


class BodySizeLimit:
    """ASGI middleware: 413 for bodies over `max_bytes`, declared or streamed (chunked bodies are
    read here, at most `max_bytes` of them, before the app sees them); counts every response by
    status class, including the 500 it sends for an unhandled exception."""

    def __init__(self, app, max_bytes: int, metrics: EnvMetrics | None = None):
        self.app, self.max_bytes, self.metrics = app, max_bytes, metrics

    def _too_large(self) -> JSONResponse:
        return JSONResponse(
            {
                "error": {
                    "code": "body_too_large",
                    "message": f"request body exceeds {self.max_bytes} bytes (--max-body-bytes)",
                }
            },
            413,
        )

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        started = False
        inner_send, metrics = send, self.metrics

        async def send(message):  # count responses by status class (plain ASGI: cheap)
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                if metrics is not None:
                    metrics.http_response(message["status"])
            await inner_send(message)

        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            return await self._too_large()(scope, receive, send)
        if declared is None and b"transfer-encoding" in headers:
            # A streamed body has no declared size: read it here, so that the limit gives 413
            # rather than the body parser's 400.
            body = bytearray()
            while True:
                message = await receive()
                if message["type"] != "http.request":
                    return  # the client went away
                body += message.get("body", b"")
                if len(body) > self.max_bytes:
                    return await self._too_large()(scope, receive, send)
                if not message.get("more_body", False):
                    break
            replayed = False
            outer_receive = receive

            async def receive():
                nonlocal replayed
                if not replayed:
                    replayed = True
                    return {"type": "http.request", "body": bytes(body), "more_body": False}
                return await outer_receive()

        try:
            await self.app(scope, receive, send)
        except Exception:  # noqa: BLE001 - answer (and count) the 500 here, inside the metrics
            _log.exception("unhandled error in %s %s", scope.get("method"), scope.get("path"))
            if not started:
                message = "internal server error (logged by the server); the request may be retried"
                await JSONResponse({"error": {"code": "internal_error", "message": message}}, 500)(scope, receive, send)


class PathToken:
    """ASGI middleware: `/t/TOKEN/REST` is served as `/REST` with `Authorization: Bearer TOKEN`.

    OpenEnv's 0.3 clients send no headers and append `/ws` to their base URL (a `?token=` query
    would end up as `?token=T/ws`), and `openenv validate --url` sends none either: with
    `base_url = http://HOST:PORT/t/TOKEN` every endpoint, the socket and `/mcp` included, is
    authenticated by the same bearer check. The server's access log is off (`cli.py`), so the
    token in the path is not written anywhere."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] in ("http", "websocket") and scope["path"].startswith("/t/"):
            token, _, rest = scope["path"][3:].partition("/")
            headers = [(k, v) for k, v in scope.get("headers") or [] if k != b"authorization"]
            scope = {
                **scope,
                "path": "/" + rest,
                "raw_path": ("/" + rest).encode(),
                "headers": [*headers, (b"authorization", b"Bearer " + token.encode("latin-1", "replace"))],
            }
        await self.app(scope, receive, send)


async def _error_response(_: Request, exc: Exception) -> JSONResponse:
    """The one handler for ApiError and every type in `_ERROR_STATUS`."""
    if isinstance(exc, ApiError):
        status, code, message, headers = exc.status, exc.code, exc.message, exc.headers
    else:
        status, code, headers = next(_ERROR_STATUS[t] for t in type(exc).__mro__ if t in _ERROR_STATUS)
        message = str(exc)
    return JSONResponse({"error": {"code": code, "message": message}}, status, headers=headers)


def _add_error_handlers(app: FastAPI) -> None:
    exc_types: tuple[type[Exception], ...] = (ApiError, *_ERROR_STATUS)
    for exc_type in exc_types:
        app.add_exception_handler(exc_type, _error_response)

    @app.exception_handler(RequestValidationError)
    async def invalid(_, exc: RequestValidationError):
        code, message = _validation_message(exc)
        return JSONResponse({"error": {"code": code, "message": message}}, 400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        message = exc.detail if exc.status_code != 404 else f"no route {request.method} {request.url.path}"
        if exc.status_code == 405:
            message = f"method {request.method} is not allowed on {request.url.path}"
        return JSONResponse({"error": {"code": "http_error", "message": str(message)}}, exc.status_code)


def _bearer_auth(token: str) -> Callable[..., Awaitable[None]]:
    """The dependency that checks `Authorization: Bearer TOKEN` (401 otherwise)."""
    bearer = HTTPBearer(auto_error=False, description="the token printed by `composer-jax env-server`")

    # async: a plain `def` dependency would cost a thread-pool round trip on every request.
    async def authorize(creds: HTTPAuthorizationCredentials | None = Depends(bearer)) -> None:
        if creds is None or not secrets.compare_digest(creds.credentials.encode(), token.encode()):
            raise ApiError(
                401,
                "unauthorized",
                "missing or wrong bearer token (Authorization: Bearer TOKEN)",
                {"WWW-Authenticate": "Bearer"},
            )

    return authorize


def _add_server_routes(app: FastAPI, manager: SessionManager, auth: list) -> None:
    """/health, /metrics, /tasks, /tools: the server itself."""

    @app.get("/health", summary="Liveness and capacity (no authentication)")
    async def health() -> dict[str, Any]:
        return {
            "status": "healthy",  # OpenEnv's HealthStatus.HEALTHY, which `openenv validate` expects
            "sessions": len(manager),
            "max_sessions": manager.max_sessions,
            "sandbox": manager.sandbox.describe(),
            "volumes": volume_kind(),
        }

    @app.get("/metrics", summary="Prometheus metrics", response_class=PlainTextResponse, dependencies=auth)
    async def get_metrics() -> Response:
        return Response(manager.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/tasks", summary="Tasks this server can run", dependencies=auth)
    async def list_tasks() -> dict[str, Any]:
        store = manager.store
        return {
            "tasks": [
                {
                    "task_id": t.task_id,
                    "runnable": t.runnable,
                    "not_runnable_reason": t.not_runnable_reason,
                    "metadata": t.config.metadata,
                }
                for t in store.tasks()
            ],
            "families": ["gen/" + f for f in store.families()],
            "invalid": store.errors,
        }

    @app.get("/tools", summary="Tool schemas (OpenAI function-calling format)", dependencies=auth)
    async def list_tools() -> list[dict[str, Any]]:
        return protocol.tool_schemas(manager.offered_tools())  # a session's own: POST /sessions


def _add_openenv_routes(app: FastAPI, manager: SessionManager, auth: list, hosts: mcp_http.HostPolicy) -> None:
    """/metadata, /schema and POST /mcp: what OpenEnv's servers serve besides /ws and /health; /mcp
    answers requests addressed to one of `hosts`."""

    @app.get("/metadata", summary="Environment metadata (OpenEnv)", dependencies=auth)
    async def metadata() -> dict[str, Any]:
        return {**op.METADATA, "tasks": len(manager.store.ids()), "families": manager.store.families()}

    @app.get("/schema", summary="JSON schemas of actions, observations and state (OpenEnv)", dependencies=auth)
    async def schema() -> dict[str, Any]:
        return op.SCHEMAS

    sessions = mcp.McpSessions(manager)  # Mcp-Session-Id -> environment session (mcp.py)

    @app.post(
        "/mcp",
        summary="MCP JSON-RPC 2.0 (streamable HTTP; OpenEnv's tools/list, tools/call, openenv/session/*)",
        dependencies=auth,
    )
    async def mcp_post(request: Request) -> Response:
        return await mcp_http.post(request, manager, sessions, hosts)

    @app.delete("/mcp", summary="End an MCP session (Mcp-Session-Id)", status_code=204, dependencies=auth)
    async def mcp_delete(request: Request) -> Response:
        return await mcp_http.delete(request, sessions, hosts)

    @app.get("/mcp", summary="MCP's server-to-client stream: not offered (405)", dependencies=auth)
    async def mcp_get() -> Response:
        return mcp_http.get()


def _add_schema_routes(app: FastAPI, auth: list) -> None:
    """/openapi.json and /docs, authenticated like everything but /health."""

    @app.get("/openapi.json", include_in_schema=False, dependencies=auth)
    async def openapi_schema() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=auth)
    async def swagger_ui() -> Response:
        return get_swagger_ui_html(openapi_url="/openapi.json", title=app.title)


def _add_session_routes(app: FastAPI, manager: SessionManager, auth: list) -> None:
    """/sessions...: create, inspect, call tools, grade, close. Errors propagate as typed exceptions."""

    @app.post(
        "/sessions",
        status_code=201,
        response_model=CreateSessionResponse,
        summary="Create a session from a task",
        dependencies=auth,
    )
    async def create_session(body: CreateSessionRequest) -> CreateSessionResponse:
        s = await manager.create(body.task_id, body.seed, body.ttl_s, episode_id=body.episode_id)
        return CreateSessionResponse(
            session_id=s.session_id,
            task_id=s.task.task_id,
            seed=s.seed,
            instruction=s.task.instruction,
            tools=protocol.tool_schemas(s.tool_names),
            expires_at=s.last_used + s.ttl_s,
        )

    @app.get("/sessions/{session_id}", summary="Session state", dependencies=auth)
    async def session_state(session_id: str = _SESSION_ID) -> dict[str, Any]:
        return manager.get(session_id).state()

    @app.post(
        "/sessions/{session_id}/tools",
        response_model=ToolCallsResponse,
        summary="Call tools (several calls run in parallel)",
        dependencies=auth,
    )
    async def call_tools(body: ToolCallsRequest, session_id: str = _SESSION_ID) -> Response:
        session = manager.get(session_id)  # an unknown session is a 404 even when the calls are bad too
        calls = parse_calls(body.calls, session.tool_names)
        results = await manager.call_tools(session_id, calls)
        return _tool_calls_response(session_id, body.calls, results)

    @app.post(
        "/sessions/{session_id}/grade",
        response_model=GradeResponse,
        summary="Run the task's tests on a copy of the workspace",
        dependencies=auth,
    )
    async def grade(session_id: str = _SESSION_ID) -> GradeResponse:
        result = await manager.grade(session_id)
        return GradeResponse(session_id=session_id, **result.to_dict())

    @app.delete("/sessions/{session_id}", summary="Close a session", dependencies=auth)
    async def close_session(session_id: str = _SESSION_ID) -> dict[str, Any]:
        return await manager.close(session_id)


def _add_websocket_routes(app: FastAPI, manager: SessionManager, token: str) -> None:
    @app.websocket("/ws")
    async def ws(websocket: WebSocket):
        await serve_openenv_websocket(websocket, manager, token)


def create_app(
    manager: SessionManager,
    token: str,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    reaper_interval_s: float = 5.0,
    hosts: mcp_http.HostPolicy = mcp_http.LOOPBACK_HOSTS,
) -> FastAPI:
    """The ASGI app serving `manager`'s sessions, authenticated with `token`; /mcp answers requests
    whose Host (and Origin) is one of `hosts` (default: a loopback server's names)."""

    @asynccontextmanager
    async def lifespan(app):
        manager.start_reaper(reaper_interval_s)
        yield
        await manager.shutdown()

    app = FastAPI(
        title="composer_jax environment server",
        version="1.0",
        lifespan=lifespan,
        description=__doc__,
        responses=_ERRORS,
        # Served below behind the token: only /health answers without it.
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    app.state.manager, app.state.token, app.state.max_body_bytes = manager, token, max_body_bytes
    app.add_middleware(BodySizeLimit, max_bytes=max_body_bytes, metrics=manager.metrics)
    app.add_middleware(PathToken)  # outermost: the path form is rewritten before anything else
    _add_error_handlers(app)
    auth = [Depends(_bearer_auth(token))]
    _add_server_routes(app, manager, auth)
    _add_openenv_routes(app, manager, auth, hosts)
    _add_schema_routes(app, auth)
    _add_session_routes(app, manager, auth)
    _add_websocket_routes(app, manager, token)
    return app
