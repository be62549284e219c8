"""A whole session through the OpenEnv-compatible WebSocket endpoint (reset/step/state/close)."""

from __future__ import annotations

import json

import pytest
from conftest import requires_bwrap
from websockets.exceptions import ConnectionClosed, WebSocketException
from websockets.sync.client import connect

pytestmark = requires_bwrap


def ws_url(server, path="/ws"):
    return server.url.replace("http://", "ws://") + path


def ask(ws, message):
    ws.send(json.dumps(message))
    return json.loads(ws.recv(timeout=60))


def test_whole_session_over_websocket(server):
    with connect(ws_url(server), additional_headers={"Authorization": f"Bearer {server.token}"}) as ws:
        assert (
            ask(ws, {"type": "step", "data": {"name": "list_dir", "arguments": {}}})["data"]["code"] == "SESSION_ERROR"
        )
        reset = ask(ws, {"type": "reset", "data": {"task_id": "fix-add", "episode_id": "ep-1"}})
        assert reset["type"] == "observation" and reset["data"]["done"] is False and reset["data"]["reward"] is None
        obs = reset["data"]["observation"]
        assert "calc.add" in obs["instruction"] and obs["episode_id"] == "ep-1" and len(obs["tools"]) == 6
        step = ask(
            ws,
            {
                "type": "step",
                "data": {
                    "tool_calls": [
                        {"name": "read_file", "arguments": {"path": "calc.py", "start_line": 6, "end_line": 6}},
                        {"type": "function", "function": {"name": "run_shell", "arguments": '{"command": "echo hi"}'}},
                    ]
                },
            },
        )
        results = step["data"]["observation"]["results"]
        assert results[0]["result"]["content"] == "    return a - b\n" and results[1]["result"]["stdout"] == "hi\n"
        step = ask(
            ws,
            {
                "type": "step",
                "data": {
                    "name": "edit_file",
                    "arguments": {"path": "calc.py", "old_string": "a - b", "new_string": "a + b"},
                },
            },
        )
        assert step["data"]["observation"]["results"][0]["ok"]
        bad = ask(ws, {"type": "step", "data": {"name": "format_disk", "arguments": {}}})
        assert bad["type"] == "error" and bad["data"]["code"] == "VALIDATION_ERROR"
        state = ask(ws, {"type": "state"})
        assert state["data"]["episode_id"] == obs["session_id"] and state["data"]["step_count"] == 2
        done = ask(ws, {"type": "step", "data": {"submit": True}})
        assert done["data"]["done"] is True and done["data"]["reward"] == 1.0
        assert all(t["outcome"] == "passed" for t in done["data"]["observation"]["grade"]["tests"])
        assert ask(ws, "not an object")["data"]["code"] == "UNKNOWN_TYPE"
        ws.send("{not json")
        assert json.loads(ws.recv(timeout=10))["data"]["code"] == "INVALID_JSON"
        ws.send(json.dumps({"type": "close"}))
        with pytest.raises(ConnectionClosed):
            ws.recv(timeout=10)
    with connect(ws_url(server, f"/t/{server.token}/ws")) as ws:  # path-token form, as OpenEnv clients use
        reset = ask(ws, {"type": "reset", "data": {"task_id": "write-hello"}})
        sid = reset["data"]["observation"]["session_id"]
    # the socket went away, so its session was closed
    import httpx

    assert (
        httpx.get(f"{server.url}/sessions/{sid}", headers={"Authorization": f"Bearer {server.token}"}).status_code
        == 404
    )


def test_websocket_requires_token(server):
    with pytest.raises(WebSocketException):  # the handshake is refused (HTTP 401/403)
        with connect(ws_url(server)) as ws:
            ws.send(json.dumps({"type": "reset", "data": {"task_id": "fix-add"}}))
            ws.recv(timeout=10)
    with pytest.raises(WebSocketException):
        with connect(ws_url(server, "/t/wrong-token-0123456789/ws")) as ws:
            ws.recv(timeout=10)
