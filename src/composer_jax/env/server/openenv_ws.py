"""OpenEnv's WebSocket protocol (`/ws`), so OpenEnv's own clients drive the server unchanged.

OpenEnv's `EnvClient` connects to `{base_url}/ws` and exchanges JSON messages `{"type", "data"}`:

    reset  data: {task_id?, seed?, episode_id?, ttl_s?}  -> observation (a fresh episode)
    step   data: an action (openenv_protocol.py)          -> observation {observation, reward, done}
    state                                                 -> state {episode_id, step_count, ...}
    mcp    data: a JSON-RPC request (mcp.py)              -> mcp {a JSON-RPC response}
    close                                                 (the session is closed, then the socket)
    errors: {"type": "error", "data": {"message", "code"}} with OpenEnv's codes INVALID_JSON,
            UNKNOWN_TYPE, VALIDATION_ERROR, CAPACITY_REACHED, SESSION_ERROR

Like OpenEnv's server: a reset without `task_id` picks a task by the seed (drawn when absent) and
unknown reset arguments are ignored; a reset of a socket's session starts a new episode under the
same session id. `/ws?session_id=ID` attaches to a session created with `openenv/session/create`
over `POST /mcp` (OpenEnv 0.10's `MCPToolClient` does this); closing such a socket detaches it
and leaves the session to `openenv/session/close`. A socket that owns its session closes it when
it disconnects.

A step is an observation whatever the model asked for: a bad call is a result with `ok: false`
(or, for `call_tool`, OpenEnv's `error` with `tool_not_found` / `invalid_args`). After a submit
the episode is done: further steps change nothing and answer `done: true` until a reset.
Error frames are for the caller's mistakes: no session yet, a malformed message, a bad reset.
Authentication is checked by `server.py` (a bearer header, or the `/t/TOKEN/ws` path form).
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from fastapi import WebSocket, WebSocketDisconnect

from composer_jax.env.api.errors import CapacityError, SessionBusy, SessionNotFound, TaskError, TaskNotRunnable
from composer_jax.env.server import mcp
from composer_jax.env.server import openenv_protocol as op
from composer_jax.env.server.session import Session, SessionManager

POLICY_VIOLATION = 1008
RESET_KEYS = ("task_id", "seed", "episode_id", "ttl_s")


def authorized(websocket: WebSocket, token: str) -> bool:
    header = websocket.headers.get("authorization", "")
    if not header.lower().startswith("bearer "):
        return False
    return secrets.compare_digest(header[7:].strip().encode(), token.encode())


def _error(message: str, code: str) -> dict:
    return {"type": "error", "data": {"message": message, "code": code}}


def _observation(observation: dict, reward: float | None = None, done: bool = False) -> dict:
    return {"type": "observation", "data": {"observation": observation, "reward": reward, "done": done}}


class _Connection:
    """One socket: at most one session at a time, owned (made by a reset here) or attached."""

    def __init__(self, websocket: WebSocket, manager: SessionManager):
        self.ws, self.manager = websocket, manager
        self.session_id: str | None = None
        self.owned = True

    def _tool_names(self) -> tuple[str, ...]:
        """This socket's session's tools; with no session, every tool the server may offer."""
        if self.session_id is not None:
            try:
                return self.session().tool_names
            except SessionNotFound:
                pass
        return self.manager.offered_tools()

    def session(self) -> Session:
        assert self.session_id is not None
        try:
            return self.manager.get(self.session_id)
        except SessionNotFound:
            self.session_id = None
            raise

    async def reset(self, data: Any) -> dict:
        if not isinstance(data, dict):
            return _error(f"reset data must be an object with any of {list(RESET_KEYS)}", "VALIDATION_ERROR")
        task_id = data.get("task_id")
        if task_id is not None and not isinstance(task_id, str):
            return _error(f"task_id {task_id!r:.80} must be a task directory name or gen/<family>", "VALIDATION_ERROR")
        args = (task_id, data.get("seed"), data.get("ttl_s"))
        try:
            if self.session_id is not None:
                session = await self.manager.reset(self.session_id, *args, episode_id=data.get("episode_id"))
            else:
                session = await self.manager.create(*args, episode_id=data.get("episode_id"))
                self.session_id, self.owned = session.session_id, True
        except CapacityError as exc:
            return _error(str(exc), "CAPACITY_REACHED")
        except (TaskError, TaskNotRunnable) as exc:
            return _error(str(exc), "VALIDATION_ERROR")
        except SessionBusy as exc:
            return _error(str(exc), "SESSION_ERROR")
        except SessionNotFound as exc:
            self.session_id = None
            return _error(str(exc), "SESSION_ERROR")
        return _observation(op.reset_observation(session))

    async def step(self, action: Any) -> dict:
        kind = action.get("type") if isinstance(action, dict) else None
        if kind == "list_tools":  # discovery needs no session (as in OpenEnv)
            return _observation({"tools": op.mcp_tools(names=self._tool_names()), "metadata": {}})
        if self.session_id is None:
            return _error('no session: send {"type": "reset"} first', "SESSION_ERROR")
        try:
            session = self.session()
            if kind == "call_tool":
                assert isinstance(action, dict)
                name = action.get("tool_name")
                result, error = await mcp.call_one(self.manager, session, name, action.get("arguments", {}))
                obs = op.call_tool_observation(name, result, error)
                return _observation(obs, session.last_reward if session.done else None, session.done)
            if session.done:
                return _observation({"results": [], "error": op.EPISODE_DONE}, session.last_reward, True)
            session.step_count += 1
            if isinstance(action, dict) and action.get("submit") is True:
                grade = await self.manager.grade(self.session_id)
                session.done = True
                return _observation({"grade": grade.to_dict()}, grade.reward, True)
            return _observation({"results": await self._call_tools(action)})
        except SessionBusy as exc:
            return _error(str(exc), "SESSION_ERROR")
        except SessionNotFound as exc:
            self.session_id = None
            return _error(str(exc), "SESSION_ERROR")

    async def _call_tools(self, action: Any) -> list[dict]:
        """Every call's result in call order: the well-formed ones run (in parallel), the others
        are results with ok false and the reason."""
        assert self.session_id is not None
        calls = op.split_calls(action, self.session().tool_names)
        good = [parsed for _, _, parsed in calls if isinstance(parsed, tuple)]
        outcomes = iter(await self.manager.call_tools(self.session_id, good) if good else [])
        results = []
        for call_id, name, parsed in calls:
            outcome = next(outcomes) if isinstance(parsed, tuple) else {"ok": False, "error": parsed, "duration_s": 0.0}
            results.append({"id": call_id, "name": name, **outcome})
        return results

    async def state(self) -> dict:
        if self.session_id is None:
            return _error('no session: send {"type": "reset"} first', "SESSION_ERROR")
        try:
            return {"type": "state", "data": op.state(self.session())}
        except SessionNotFound as exc:
            return _error(str(exc), "SESSION_ERROR")

    async def rpc(self, data: Any) -> dict:
        return {"type": "mcp", "data": await mcp.handle(self.manager, data, self.session_id)}

    async def release(self) -> None:
        """The socket is gone: close an owned session, detach from an attached one."""
        if self.session_id is None:
            return
        if not self.owned:
            try:
                self.manager.get(self.session_id).attached = False
            except SessionNotFound:
                pass
            return
        try:
            await self.manager.close(self.session_id, reason="websocket")
        except SessionNotFound:
            pass


async def serve_openenv_websocket(websocket: WebSocket, manager: SessionManager, token: str) -> None:
    """Run one WebSocket connection until it closes."""
    if not authorized(websocket, token):
        await websocket.close(code=POLICY_VIOLATION, reason="missing or wrong token")
        return
    await websocket.accept()
    conn = _Connection(websocket, manager)
    attach = websocket.query_params.get("session_id")
    if attach is not None:
        try:
            session = manager.get(attach)
        except SessionNotFound as exc:
            await websocket.send_json(_error(str(exc), "SESSION_ERROR"))
            await websocket.close()
            return
        if session.attached:
            await websocket.send_json(_error(f"session {attach!r} already has a socket attached", "SESSION_ERROR"))
            await websocket.close()
            return
        session.attached = True
        conn.session_id, conn.owned = attach, False
    try:
        while True:
            raw = await websocket.receive_text()
            try:
                msg = json.loads(raw)
            except json.JSONDecodeError as exc:
                await websocket.send_json(_error(f"message is not valid JSON: {exc}", "INVALID_JSON"))
                continue
            kind = msg.get("type") if isinstance(msg, dict) else None
            data = msg.get("data", {}) if isinstance(msg, dict) else {}
            if kind == "close":
                break
            if kind == "reset":
                reply = await conn.reset(data)
            elif kind == "step":
                reply = await conn.step(data)
            elif kind == "state":
                reply = await conn.state()
            elif kind == "mcp":
                reply = await conn.rpc(data)
            else:
                reply = _error(
                    f"unknown message type {kind!r:.80}; accepted: reset, step, state, mcp, close", "UNKNOWN_TYPE"
                )
            await websocket.send_json(reply)
    except WebSocketDisconnect:
        pass
    finally:
        await conn.release()
    try:
        await websocket.close()
    except RuntimeError:
        pass  # already closed by the client
