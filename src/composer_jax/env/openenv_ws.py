"""OpenEnv-compatible WebSocket sessions, so existing OpenEnv clients can drive the server.

OpenEnv's `EnvClient` connects to `{base_url}/ws` and exchanges JSON messages:

    -> {"type": "reset", "data": {"task_id": "...", "seed": 0, "episode_id": "..."}}
    <- {"type": "observation", "data": {"observation": {...}, "reward": null, "done": false}}
    -> {"type": "step", "data": ACTION}
    <- {"type": "observation", "data": {"observation": {...}, "reward": r, "done": d}}
    -> {"type": "state"}
    <- {"type": "state", "data": {"episode_id": SESSION_ID, "step_count": n, ...}}
    -> {"type": "close"}                     (the session is closed, then the socket)
    <- {"type": "error", "data": {"message": "...", "code": "INVALID_JSON" | "UNKNOWN_TYPE" |
                                   "VALIDATION_ERROR" | "EXECUTION_ERROR" | "CAPACITY_REACHED" |
                                   "SESSION_ERROR"}}

ACTION is one of
    {"tool_calls": [{"id"?, "name": ..., "arguments": {...}}, ...]}   several calls, run in parallel
    {"name": ..., "arguments": {...}}                                one call
    {"submit": true}                                                 grade; done = true, reward set
Authentication: `Authorization: Bearer TOKEN`, or `?token=TOKEN`, or the path form
`/t/TOKEN/ws` (OpenEnv clients append `/ws` to their base URL and send no headers).
A socket that disconnects closes its session.
"""

from __future__ import annotations

import json
import secrets
from typing import Any

from fastapi import WebSocket, WebSocketDisconnect

from composer_jax.env import protocol
from composer_jax.env.errors import CapacityError, SessionBusy, SessionNotFound, TaskError, TaskNotRunnable
from composer_jax.env.session import SessionManager

POLICY_VIOLATION = 1008


def _authorized(websocket: WebSocket, token: str, path_token: str | None) -> bool:
    offered = path_token or websocket.query_params.get("token")
    header = websocket.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        offered = header[7:].strip()
    if not offered:
        return False
    return secrets.compare_digest(offered.encode(), token.encode())


def _error(message: str, code: str) -> dict:
    return {"type": "error", "data": {"message": message, "code": code}}


def _observation(observation: dict, reward: float | None = None, done: bool = False) -> dict:
    return {"type": "observation", "data": {"observation": observation, "reward": reward, "done": done}}


def _calls_from_action(action: Any) -> list[tuple[str, dict]]:
    """A step's data -> checked (name, arguments) calls; ToolArgumentError names the first bad one."""
    if not isinstance(action, dict):
        raise protocol.ToolArgumentError(
            'step data must be an object: {"tool_calls": [...]}, {"name", "arguments"} or {"submit": true}'
        )
    raw = action.get("tool_calls") if "tool_calls" in action else [action]
    if not isinstance(raw, list) or not raw:
        raise protocol.ToolArgumentError("tool_calls must be a non-empty list")
    calls = []
    for i, call in enumerate(raw):
        call = protocol.unwrap_call(call)
        if not isinstance(call, dict):
            raise protocol.ToolArgumentError(f"tool_calls[{i}] must be an object with name and arguments")
        calls.append(protocol.parse_call(call.get("name"), call.get("arguments", {}), f"tool_calls[{i}]"))
    return calls


async def serve_openenv_websocket(
    websocket: WebSocket, manager: SessionManager, token: str, path_token: str | None
) -> None:
    """Run one WebSocket connection (at most one session at a time) until it closes."""
    if not _authorized(websocket, token, path_token):
        await websocket.close(code=POLICY_VIOLATION, reason="missing or wrong token")
        return
    await websocket.accept()
    session_id: str | None = None
    steps = 0
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
                if not isinstance(data, dict) or not isinstance(data.get("task_id"), str):
                    await websocket.send_json(
                        _error(
                            'reset data must include "task_id" (a task directory name or gen/<family>)',
                            "VALIDATION_ERROR",
                        )
                    )
                    continue
                if session_id is not None:
                    await manager.close(session_id, reason="reset")
                    session_id = None
                try:
                    session = await manager.create(data["task_id"], data.get("seed"), data.get("ttl_s"))
                except CapacityError as exc:
                    await websocket.send_json(_error(str(exc), "CAPACITY_REACHED"))
                    continue
                except (TaskError, TaskNotRunnable, ValueError, TypeError) as exc:
                    await websocket.send_json(_error(str(exc), "VALIDATION_ERROR"))
                    continue
                session_id, steps = session.session_id, 0
                await websocket.send_json(
                    _observation(
                        {
                            "session_id": session_id,
                            "task_id": session.task.task_id,
                            "seed": session.seed,
                            "instruction": session.task.instruction,
                            "tools": protocol.TOOL_SCHEMAS,
                            "episode_id": data.get("episode_id"),
                        }
                    )
                )
            elif kind in ("step", "state") and session_id is None:
                await websocket.send_json(
                    _error('no session: send {"type": "reset", "data": {"task_id": ...}} first', "SESSION_ERROR")
                )
            elif kind == "step" and session_id is not None:  # None was answered just above
                try:
                    if isinstance(data, dict) and data.get("submit"):
                        result = await manager.grade(session_id)
                        steps += 1
                        await websocket.send_json(_observation({"grade": result.to_dict()}, result.reward, True))
                        continue
                    calls = _calls_from_action(data)
                    results = await manager.call_tools(session_id, calls)
                except protocol.ToolArgumentError as exc:
                    await websocket.send_json(_error(str(exc), "VALIDATION_ERROR"))
                    continue
                except SessionBusy as exc:
                    await websocket.send_json(_error(str(exc), "SESSION_ERROR"))
                    continue
                except SessionNotFound as exc:
                    session_id = None
                    await websocket.send_json(_error(str(exc), "SESSION_ERROR"))
                    continue
                steps += 1
                await websocket.send_json(
                    _observation({"results": [{"name": name, **r} for (name, _), r in zip(calls, results)]})
                )
            elif kind == "state" and session_id is not None:
                try:
                    state = manager.get(session_id).state()
                except SessionNotFound as exc:
                    session_id = None
                    await websocket.send_json(_error(str(exc), "SESSION_ERROR"))
                    continue
                await websocket.send_json(
                    {"type": "state", "data": {"episode_id": session_id, "step_count": steps, **state}}
                )
            else:
                await websocket.send_json(
                    _error(f"unknown message type {kind!r}; accepted: reset, step, state, close", "UNKNOWN_TYPE")
                )
    except WebSocketDisconnect:
        pass
    finally:
        if session_id is not None:
            try:
                await manager.close(session_id, reason="websocket")
            except SessionNotFound:
                pass
    try:
        await websocket.close()
    except RuntimeError:
        pass  # already closed by the client
