"""The Model Context Protocol on /mcp, driven by the official `mcp` SDK's own client
(`streamable_http_client` + `ClientSession`), and every answer validated against the SDK's pydantic
types. Expected values are worked by hand from the fixture task `fix-add` (`calc.py`: `add` on line
4 returns `a - b` on line 6; its three tests pass once that is `a + b`)."""

from __future__ import annotations

import asyncio
import json
import shutil
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from mcp import ClientSession, types
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.exceptions import McpError
from support.live_server import FIXTURE_TASKS

from composer_jax.env.api.protocol import BASE_TOOL_NAMES, TOOL_NAMES
from composer_jax.env.sandbox.runner import LocalProcessSandbox
from composer_jax.env.server import mcp as env_mcp
from composer_jax.env.server.app import create_app
from composer_jax.env.server.mcp_http import LOOPBACK_HOSTS, HostPolicy
from composer_jax.env.server.session import SessionManager
from composer_jax.env.tasks.store import TaskStore
from composer_jax.env.tools.web_search import WebTools

TOKEN = "t" * 32
HEADERS = {"Authorization": f"Bearer {TOKEN}"}
ACCEPT = "application/json, text/event-stream"  # what the SDK's client sends
INIT_PARAMS = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "test", "version": "0"}}


class GradeRequest(types.Request[types.RequestParams | None, str]):
    """This server's grading method, sent through the SDK's session like any request."""

    method: str = env_mcp.GRADE
    params: types.RequestParams | None = None


class GradeResult(types.Result):
    reward: float
    tests: list[dict[str, Any]]


class StubWeb:
    """A web backend that is never asked anything: only which sessions are offered the tools matters."""

    name = "stub"

    def prepare(self) -> None:
        pass

    def search(self, query: str, k: int) -> list[dict]:
        raise AssertionError("not called")

    def read(self, url: str, offset: int = 0) -> dict:
        raise AssertionError("not called")


@pytest.fixture
def app(tmp_path):
    """The server app on fix-add and web-add (fix-add with `[agent] web_search = true`), with the
    local-process sandbox: the MCP layer, not the sandbox, is under test here."""
    tasks = tmp_path / "tasks"
    shutil.copytree(FIXTURE_TASKS / "fix-add", tasks / "fix-add")
    shutil.copytree(FIXTURE_TASKS / "fix-add", tasks / "web-add")
    toml = tasks / "web-add" / "task.toml"
    toml.write_text(toml.read_text().replace("[agent]\n", "[agent]\nweb_search = true\n"))
    web = WebTools(StubWeb(), "tasks")
    manager = SessionManager(
        TaskStore(tasks, tmp_path / "cache"), LocalProcessSandbox(), work_dir=tmp_path / "w", web_tools=web
    )
    return create_app(manager, TOKEN, hosts=HostPolicy.for_bind("127.0.0.1", ["testserver"]))  # TestClient's Host


def rpc(method: str, params: dict | None = None, request_id: int | None = 1) -> dict:
    body: dict[str, Any] = {"jsonrpc": "2.0", "method": method}
    if params is not None:
        body["params"] = params
    if request_id is not None:
        body["id"] = request_id
    return body


def result_of(r: httpx.Response) -> dict:
    message = types.JSONRPCMessage.model_validate_json(r.content).root
    assert isinstance(message, types.JSONRPCResponse), r.text
    return message.result


def error_of(r: httpx.Response) -> types.ErrorData:
    """The error of a JSON-RPC error body. With no request id to echo (a transport error, a parse
    error) its id is null, as JSON-RPC 2.0 says; the SDK's JSONRPCError type requires an id, so
    such a body is checked field by field."""
    body = r.json()
    if body.get("id", 0) is None:
        assert set(body) == {"jsonrpc", "id", "error"} and body["jsonrpc"] == "2.0", body
        return types.ErrorData.model_validate(body["error"])
    message = types.JSONRPCMessage.model_validate_json(r.content).root
    assert isinstance(message, types.JSONRPCError), r.text
    return message.error


def test_answers_validate_against_the_sdk_types(app):
    with TestClient(app, headers=HEADERS) as c:
        init = c.post("/mcp?task_id=fix-add&seed=0", json=rpc("initialize", INIT_PARAMS), headers={"Accept": ACCEPT})
        assert init.status_code == 200 and init.headers["content-type"] == "application/json"
        result = types.InitializeResult.model_validate(result_of(init))
        assert result.protocolVersion == "2025-06-18" and result.capabilities.tools is not None
        assert result.serverInfo.name == "composer_jax-env" and "calc.add" in (result.instructions or "")
        assert result.meta is not None and (result.meta["task_id"], result.meta["seed"]) == ("fix-add", 0)
        env_id, mcp_id = result.meta["session_id"], init.headers["mcp-session-id"]
        assert mcp_id != env_id and c.get(f"/sessions/{env_id}").status_code == 200
        h = {"Accept": ACCEPT, "Mcp-Session-Id": mcp_id, "MCP-Protocol-Version": "2025-06-18"}

        def post(body: Any, **extra: str) -> httpx.Response:
            return c.post("/mcp", json=body, headers={**h, **extra})

        note = post(rpc("notifications/initialized", request_id=None))
        assert (note.status_code, note.content) == (202, b"")
        assert types.EmptyResult.model_validate(result_of(post(rpc("ping", request_id=2)))) is not None
        tools = types.ListToolsResult.model_validate(result_of(post(rpc("tools/list", {}, 3))))
        assert [t.name for t in tools.tools] == list(BASE_TOOL_NAMES)
        by_name = {t.name: t for t in tools.tools}
        assert by_name["read_file"].inputSchema["required"] == ["path"]
        assert by_name["read_file"].annotations is not None and by_name["read_file"].annotations.readOnlyHint
        assert by_name["run_shell"].annotations is not None and not by_name["run_shell"].annotations.readOnlyHint
        args = {"path": "calc.py", "start_line": 4, "end_line": 4}
        read = types.CallToolResult.model_validate(
            result_of(post(rpc("tools/call", {"name": "read_file", "arguments": args})))
        )
        assert not read.isError and read.structuredContent is not None
        assert read.structuredContent["content"] == "def add(a, b):\n"
        assert isinstance(read.content[0], types.TextContent)
        assert json.loads(read.content[0].text) == read.structuredContent
        bad = types.CallToolResult.model_validate(result_of(post(rpc("tools/call", {"name": "format_disk"}))))
        assert bad.isError and bad.structuredContent is not None
        assert "unknown tool 'format_disk'" in bad.structuredContent["error"]
        assert error_of(post(rpc("resources/list"))).code == types.METHOD_NOT_FOUND
        assert error_of(post(rpc("tools/call", {}))).code == types.INVALID_PARAMS
        assert error_of(post(rpc("initialize", INIT_PARAMS))).code == types.INVALID_REQUEST  # already initialized

        # one SSE event when the client accepts only the stream
        sse = post(rpc("ping", request_id=7), Accept="text/event-stream")
        assert sse.headers["content-type"].startswith("text/event-stream")
        event, data = sse.text.splitlines()[:2]
        assert (
            event == "event: message" and types.JSONRPCResponse.model_validate_json(data.removeprefix("data: ")).id == 7
        )
        # the transport's refusals, each with a JSON-RPC error body
        assert post(rpc("ping"), Accept="text/html").status_code == 406
        assert post(rpc("ping"), **{"MCP-Protocol-Version": "1999-01-01"}).status_code == 400
        assert post(rpc("ping"), Origin="http://evil.example").status_code == 403
        assert post(rpc("ping"), Origin="http://testserver").status_code == 200
        unknown = post(rpc("ping", request_id=9), **{"Mcp-Session-Id": "no-such-session"})
        assert unknown.status_code == 404 and error_of(unknown).code == env_mcp.SESSION_NOT_FOUND
        got = c.get("/mcp", headers=h)
        assert got.status_code == 405 and got.headers["allow"] == "POST, DELETE" and error_of(got).message
        assert (
            c.post("/mcp", json=rpc("initialize", INIT_PARAMS), headers={"Authorization": "Bearer nope"}).status_code
            == 401
        )
        assert c.delete("/mcp").status_code == 400
        assert c.delete("/mcp", headers=h).status_code == 204  # ends the MCP session and its own env session
        assert c.delete("/mcp", headers=h).status_code == 404 and post(rpc("ping")).status_code == 404
        assert c.get(f"/sessions/{env_id}").status_code == 404

        # initialize's choices: the newest revision for an unknown one; errors name the bad value
        newest = c.post("/mcp", json=rpc("initialize", {**INIT_PARAMS, "protocolVersion": "2099-01-01"}))
        assert result_of(newest)["protocolVersion"] == types.LATEST_PROTOCOL_VERSION == env_mcp.PROTOCOL_VERSIONS[-1]
        assert c.delete("/mcp", headers={"Mcp-Session-Id": newest.headers["mcp-session-id"]}).status_code == 204
        assert "seed='x'" in error_of(c.post("/mcp?seed=x", json=rpc("initialize", INIT_PARAMS))).message
        assert "'nope'" in error_of(c.post("/mcp?task_id=nope", json=rpc("initialize", INIT_PARAMS))).message
        assert "protocolVersion" in error_of(c.post("/mcp", json=rpc("initialize", {}))).message
        clash = c.post("/mcp?task_id=fix-add", json=rpc("initialize", {**INIT_PARAMS, "task_id": "web-add"}))
        assert "task_id" in error_of(clash).message
        # without Mcp-Session-Id: OpenEnv's sessionless surface (tests/env/server/test_openenv_ws.py has the rest)
        assert [t["name"] for t in result_of(c.post("/mcp", json=rpc("tools/list")))["tools"]] == list(BASE_TOOL_NAMES)


def test_host_and_origin_must_name_this_server(app):
    """The DNS-rebinding defence: a page on evil.example rebound to 127.0.0.1 sends `Host:
    evil.example:PORT` and the matching Origin, which agree with each other, so only a Host that
    must be one of the server's names refuses it. Allowed: the server's names with no Origin (the
    SDK's client and OpenEnv's send none) or with the server's own origin."""
    with TestClient(app, headers=HEADERS) as c:

        def status(host: str, origin: str | None = None) -> int:
            headers = {"Host": host} | ({"Origin": origin} if origin is not None else {})
            return c.post("/mcp", json=rpc("ping"), headers=headers).status_code

        refused = c.post("/mcp", json=rpc("ping"), headers={"Host": "evil.example:8000"})
        assert refused.status_code == 403
        assert "'evil.example:8000' is not one of this server's names (127.0.0.1, ::1, localhost, testserver)" in (
            error_of(refused).message
        )
        for host, origin in [
            ("evil.example:8000", "http://evil.example:8000"),  # rebinding: Host and Origin agree
            ("localhost.evil.example", None),
            ("10.0.0.1:8000", None),  # bound to loopback: another address is not this server's
            ("testserver", "http://evil.example"),  # a foreign page's request
            ("localhost:8000", "http://localhost:3000"),  # another local port's page
            ("localhost:8000", "null"),  # a sandboxed frame or a file:// page
            ("", None),
            ("localhost:port", None),
        ]:
            assert status(host, origin) == 403, (host, origin)
        for host, origin in [
            ("testserver", None),
            ("127.0.0.1:8000", None),
            ("[::1]:8000", "http://[::1]:8000"),
            ("LOCALHOST.:8000", "http://localhost:8000"),
            ("testserver", "http://testserver"),
            ("testserver:80", "http://testserver"),
        ]:
            assert status(host, origin) == 200, (host, origin)


def test_host_policy_follows_the_bound_address():
    loopback = LOOPBACK_HOSTS  # create_app's default: a loopback server's names
    assert loopback == HostPolicy.for_bind("127.0.0.1") and loopback.allows("::1") and not loopback.allows("testserver")
    named = HostPolicy.for_bind("10.0.0.5", ["Env.Internal."])
    assert named.allows("10.0.0.5") and named.allows("env.internal") and not named.allows("localhost")
    assert not named.allows("10.0.0.6") and named.accepted() == "10.0.0.5, env.internal"
    wildcard = HostPolicy.for_bind("0.0.0.0")  # any IP literal reaches it, and none can be rebound
    assert wildcard.allows("10.1.2.3") and wildcard.allows("fe80::1") and wildcard.allows("localhost")
    assert not wildcard.allows("evil.example") and wildcard.accepted().endswith("or any IP address of this machine")
    assert HostPolicy.for_bind("::").any_address and HostPolicy.for_bind("::1").allows("127.0.0.1")


def test_call_result_is_a_call_tool_result():
    ok = types.CallToolResult.model_validate(env_mcp.call_result({"ok": True, "result": {"entries": []}}))
    assert (ok.isError, ok.structuredContent, ok.content[0].type) == (False, {"entries": []}, "text")
    failed = types.CallToolResult.model_validate(env_mcp.call_result({"ok": False, "error": "no such file"}))
    assert failed.isError and failed.structuredContent == {"error": "no such file"}
    assert env_mcp.message_kind(rpc("ping", request_id=None)) == "notification"
    assert env_mcp.message_kind({"jsonrpc": "2.0", "id": 1, "result": {}}) == "response"
    assert env_mcp.message_kind({}) == "invalid" and env_mcp.message_kind(rpc("ping")) == "request"


async def _listed_tools(app, task_id: str) -> list[str]:
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver", headers=HEADERS) as http:
        async with streamable_http_client(f"http://testserver/mcp?task_id={task_id}", http_client=http) as (r, w, _):
            async with ClientSession(r, w) as session:
                await session.initialize()
                return [t.name for t in (await session.list_tools()).tools]


def test_a_session_lists_only_its_own_tools(app):
    """tools/list is the session's offer: web_search only where the task asks for it; a task that
    does not exist is initialize's error, which the SDK raises."""
    assert asyncio.run(_listed_tools(app, "fix-add")) == list(BASE_TOOL_NAMES)
    assert asyncio.run(_listed_tools(app, "web-add")) == TOOL_NAMES and "web_search" in TOOL_NAMES
    with pytest.raises(ExceptionGroup) as raised:  # out of the transport's task group
        asyncio.run(_listed_tools(app, "no-such-task"))
    assert raised.group_contains(McpError, match="unknown task_id 'no-such-task'")


@pytest.mark.sandbox  # the `server` fixture skips without bubblewrap
def test_sdk_client_runs_an_episode_on_a_live_server(server):
    """The SDK's client against the real server (bubblewrap sandbox): initialize, list, calls (a
    good one, bad ones as isError results), the grade, ping; leaving the client ends the session."""

    async def episode() -> dict:
        async with httpx.AsyncClient(headers=server.headers, timeout=60) as http:
            url = f"{server.url}/mcp?task_id=fix-add&episode_id=ep-9"
            async with streamable_http_client(url, http_client=http) as (r, w, mcp_id):
                async with ClientSession(r, w) as s:
                    init = await s.initialize()
                    out: dict[str, Any] = {"init": init, "mcp_id": mcp_id()}
                    out["tools"] = [t.name for t in (await s.list_tools()).tools]
                    out["read"] = await s.call_tool("read_file", {"path": "calc.py", "start_line": 6, "end_line": 6})
                    out["missing"] = await s.call_tool("read_file", {"path": "no_such_file.py"})
                    out["unknown"] = await s.call_tool("format_disk", {})
                    out["bad_arg"] = await s.call_tool("read_file", {"path": "calc.py", "bogus": 1})
                    edit = {"path": "calc.py", "old_string": "a - b", "new_string": "a + b"}
                    out["edit"] = await s.call_tool("edit_file", edit)
                    out["grade"] = await s.send_request(GradeRequest(), GradeResult)  # type: ignore[arg-type]
                    out["ping"] = await s.send_ping()
                    return out

    out = asyncio.run(episode())
    init = out["init"]
    assert init.protocolVersion == types.LATEST_PROTOCOL_VERSION and out["mcp_id"]
    assert init.meta["task_id"] == "fix-add" and init.meta["episode_id"] == "ep-9"
    assert out["tools"] == list(BASE_TOOL_NAMES)
    read = out["read"]
    assert not read.isError and read.structuredContent["content"] == "    return a - b\n"
    assert json.loads(read.content[0].text)["content"] == "    return a - b\n"
    assert out["missing"].isError and out["missing"].structuredContent == {
        "error": "/app/no_such_file.py: no such file"
    }
    assert out["unknown"].isError and "unknown tool 'format_disk'" in out["unknown"].content[0].text
    assert out["bad_arg"].isError and "'bogus'" in out["bad_arg"].content[0].text
    assert not out["edit"].isError and out["edit"].structuredContent["replacements"] == 1
    assert out["grade"].reward == 1.0 and [t["outcome"] for t in out["grade"].tests] == ["passed"] * 3
    # the client's DELETE on leaving closed the session initialize had opened
    assert httpx.get(f"{server.url}/sessions/{init.meta['session_id']}", headers=server.headers).status_code == 404
    # the live server, bound to 127.0.0.1, answers its loopback names and refuses a rebound one
    port = server.url.rsplit(":", 1)[1]
    for host, expected in (("localhost:" + port, 200), ("evil.example:" + port, 403)):
        r = httpx.post(server.url + "/mcp", json=rpc("ping"), headers={**server.headers, "Host": host})
        assert r.status_code == expected, (host, r.text)


@pytest.mark.sandbox  # the `server` fixture skips without bubblewrap
def test_sdk_client_attaches_and_sees_a_closed_session_as_terminated(server):
    """`?session_id=` attaches to a session made over REST (path-form token, no header); leaving
    leaves it open; once it is closed elsewhere, a call is the transport's 404, which the SDK's
    client reports as "Session terminated"."""
    http = server.client()
    sid = http.post("/sessions", json={"task_id": "fix-add"}).json()["session_id"]
    url = f"{server.url}/t/{server.token}/mcp?session_id={sid}"

    async def attach(close_first: bool) -> Any:
        async with httpx.AsyncClient(timeout=60) as client:
            async with streamable_http_client(url, http_client=client) as (r, w, _):
                async with ClientSession(r, w) as s:
                    meta = (await s.initialize()).meta
                    assert meta is not None and meta["session_id"] == sid
                    listing = await s.call_tool("list_dir", {})
                    if close_first:
                        assert http.delete(f"/sessions/{sid}").status_code == 200
                        with pytest.raises(McpError, match="Session terminated"):
                            await s.call_tool("list_dir", {})
                    return listing

    listing = asyncio.run(attach(close_first=False))
    assert listing.structuredContent["entries"][0]["path"] == "/app/calc.py"
    assert http.get(f"/sessions/{sid}").status_code == 200  # attached, so left open
    asyncio.run(attach(close_first=True))
    raw = http.post("/mcp", json=rpc("ping"), headers={"Mcp-Session-Id": "made-up", "Accept": ACCEPT})
    assert raw.status_code == 404 and error_of(raw).code == env_mcp.SESSION_NOT_FOUND
