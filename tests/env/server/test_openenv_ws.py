"""A whole session through the OpenEnv-compatible WebSocket endpoint (reset/step/state/close)."""

from __future__ import annotations

import json

import pytest
from support.live_server import requires_bwrap
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
        bad = ask(ws, {"type": "step", "data": {"id": "x", "name": "format_disk", "arguments": {}}})
        [result] = bad["data"]["observation"]["results"]  # a model's bad call is an observation
        assert bad["type"] == "observation" and (result["id"], result["ok"]) == ("x", False)
        state = ask(ws, {"type": "state"})
        assert state["data"]["session_id"] == obs["session_id"] and state["data"]["episode_id"] == "ep-1"
        assert state["data"]["step_count"] == 3
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


def rpc(http, method, params=None, request_id=1):
    body = {"jsonrpc": "2.0", "method": method, "id": request_id}
    if params is not None:
        body["params"] = params
    r = http.post("/mcp", json=body)
    assert r.status_code == 200, r.text  # JSON-RPC answers every request with HTTP 200
    return r.json()


def test_mcp_json_rpc(server, http):
    assert http.post("/mcp", content=b"{nope").json()["error"]["code"] == -32700
    assert http.post("/mcp", json={}).json() == {
        "jsonrpc": "2.0",
        "id": None,
        "error": {"code": -32600, "message": 'a JSON-RPC 2.0 request needs "jsonrpc": "2.0" and a string "method"'},
    }
    assert "tools/call" in rpc(http, "resources/list")["error"]["message"]  # -32601 names what is accepted
    assert rpc(http, "tools/list", [1])["error"]["code"] == -32602
    tools = rpc(http, "tools/list", request_id="a")
    assert tools["id"] == "a" and [t["name"] for t in tools["result"]["tools"]][:2] == ["read_file", "edit_file"]
    assert tools["result"]["tools"][0]["inputSchema"]["required"] == ["path"]
    assert "session_id" in rpc(http, "tools/call", {"name": "list_dir"})["error"]["message"]
    assert rpc(http, "openenv/session/create", {"task_id": "nope"})["error"]["code"] == -32602
    created = rpc(http, "openenv/session/create", {"task_id": "fix-add", "episode_id": "e7"})["result"]
    sid = created["session_id"]
    assert (created["task_id"], created["seed"], created["episode_id"]) == ("fix-add", 0, "e7")
    call = {"name": "read_file", "arguments": {"path": "calc.py", "start_line": 4, "end_line": 4}, "session_id": sid}
    result = rpc(http, "tools/call", call)["result"]
    assert result["is_error"] is False and result["data"]["content"] == "def add(a, b):\n"
    assert json.loads(result["content"][0]["text"]) == result["data"]
    bad = rpc(http, "tools/call", {"name": "format_disk", "session_id": sid})["result"]
    assert bad["is_error"] is True and "unknown tool 'format_disk'" in bad["data"]["error"]

    # a socket attaches to the session made over /mcp; only one at a time; closing it detaches
    headers = {"Authorization": f"Bearer {server.token}"}
    with connect(ws_url(server, f"/ws?session_id={sid}"), additional_headers=headers) as ws:
        with connect(ws_url(server, f"/ws?session_id={sid}"), additional_headers=headers) as second:
            assert "already has a socket" in json.loads(second.recv(timeout=30))["data"]["message"]
        state = ask(ws, {"type": "state"})["data"]
        assert (state["session_id"], state["episode_id"], state["step_count"]) == (sid, "e7", 2)
        frame = ask(
            ws,
            {
                "type": "mcp",
                "data": {
                    "jsonrpc": "2.0",
                    "id": 9,
                    "method": "tools/call",
                    "params": {"name": "list_dir", "arguments": {}},
                },
            },
        )
        assert frame["type"] == "mcp" and frame["data"]["result"]["data"]["entries"][0]["path"] == "/app/calc.py"
        reset = ask(ws, {"type": "reset", "data": {"task_id": "write-hello"}})["data"]["observation"]
        assert (reset["session_id"], reset["task_id"]) == (sid, "write-hello")  # same session, new episode
    assert http.get(f"/sessions/{sid}").json()["task_id"] == "write-hello"
    assert rpc(http, "openenv/session/close", {"session_id": sid})["result"] == {"session_id": sid, "closed": True}
    assert rpc(http, "openenv/session/close", {"session_id": sid})["error"]["code"] == -32602
    with connect(ws_url(server, f"/ws?session_id={sid}"), additional_headers=headers) as ws:
        assert json.loads(ws.recv(timeout=30))["data"]["code"] == "SESSION_ERROR"


def test_websocket_caller_errors_are_error_frames(server):
    """The caller's own mistakes (no session yet, a bad reset) are error frames; a bad reset leaves
    the socket's session as it was."""
    with connect(ws_url(server), additional_headers={"Authorization": f"Bearer {server.token}"}) as ws:
        assert ask(ws, {"type": "state"})["data"]["code"] == "SESSION_ERROR"
        assert ask(ws, {"type": "step", "data": {"submit": True}})["data"]["code"] == "SESSION_ERROR"
        bad = ask(ws, {"type": "reset", "data": {"task_id": "gpu-task"}})["data"]
        assert bad["code"] == "VALIDATION_ERROR" and "gpus = 1" in bad["message"]
        assert "[0, 2147483647]" in ask(ws, {"type": "reset", "data": {"seed": -1}})["data"]["message"]
        obs = ask(ws, {"type": "reset", "data": {"task_id": "fix-add"}})["data"]["observation"]
        bad = ask(ws, {"type": "reset", "data": {"task_id": "no-such-task"}})["data"]
        assert bad["code"] == "VALIDATION_ERROR" and "'no-such-task'" in bad["message"]
        state = ask(ws, {"type": "state"})["data"]
        assert (state["session_id"], state["task_id"]) == (obs["session_id"], "fix-add")
