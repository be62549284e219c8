"""A whole session through the HTTP API, and the API's error handling."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import httpx
import pytest
from support.live_server import FIXTURE_TASKS, LiveServer, call, env_with_src, requires_bwrap
from support.metrics_scrape import scrape

pytestmark = requires_bwrap


def test_whole_session_over_http(http):
    tasks = http.get("/tasks").json()
    assert {t["task_id"]: t["runnable"] for t in tasks["tasks"]} == {
        "fix-add": True,
        "write-hello": True,
        "needs-docker": False,
        "gpu-task": False,
    }
    created = http.post("/sessions", json={"task_id": "fix-add", "ttl_s": 600})
    assert created.status_code == 201
    body = created.json()
    sid = body["session_id"]
    assert "calc.add" in body["instruction"]
    assert [t["function"]["name"] for t in body["tools"]] == [
        "read_file",
        "edit_file",
        "list_dir",
        "grep",
        "semantic_search",
        "run_shell",
    ]
    assert all(t["type"] == "function" and t["function"]["parameters"]["type"] == "object" for t in body["tools"])

    graded = http.post(f"/sessions/{sid}/grade").json()
    assert graded["reward"] == 0.0
    assert {t["name"]: t["outcome"] for t in graded["tests"]} == {
        "test_calc::test_add": "failed",
        "test_calc::test_add_negative": "failed",
        "test_calc::test_multiply": "passed",
    }
    assert graded["diff"] == ""

    # Several calls in one request, OpenAI-shaped and plain, results in call order.
    r = http.post(
        f"/sessions/{sid}/tools",
        json={
            "calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "grep", "arguments": json.dumps({"pattern": "a - b"})},
                },
                {"id": "c2", "name": "list_dir", "arguments": {}},
                {"id": "c3", "name": "run_shell", "arguments": {"command": "sleep 0.5; echo slow"}},
                {"id": "c4", "name": "run_shell", "arguments": {"command": "sleep 0.5; echo slow2"}},
            ]
        },
    )
    results = r.json()["results"]
    assert [x["id"] for x in results] == ["c1", "c2", "c3", "c4"]
    assert results[0]["result"]["matches"][0]["line"] == 6
    assert results[1]["result"]["entries"] == [{"path": "/app/calc.py", "type": "file", "size": 176}]  # wc -c calc.py
    assert results[2]["result"]["stdout"] == "slow\n" and results[3]["result"]["stdout"] == "slow2\n"
    assert r.elapsed.total_seconds() < 0.95  # the two 0.5 s shells ran in parallel

    edit = call(http, sid, "edit_file", path="/app/calc.py", old_string="return a - b", new_string="return a + b")
    assert edit["ok"] and edit["result"]["replacements"] == 1
    graded = http.post(f"/sessions/{sid}/grade").json()
    assert graded["reward"] == 1.0 and graded["error"] is None, graded
    assert all(t["outcome"] == "passed" for t in graded["tests"])
    assert "-    return a - b\n+    return a + b\n" in graded["diff"]
    state = http.get(f"/sessions/{sid}").json()
    assert state["tool_calls"] == 5 and state["grades"] == 2 and state["last_reward"] == 1.0

    assert http.delete(f"/sessions/{sid}").json()["closed"] is True
    assert http.get(f"/sessions/{sid}").status_code == 404
    metrics = scrape(http)
    assert metrics("cj_env_tool_calls_total", outcome="ok", tool="run_shell") >= 2
    assert metrics("cj_env_grades_total") >= 2


def test_reward_json_and_grading_does_not_touch_workspace(http):
    sid = http.post("/sessions", json={"task_id": "write-hello"}).json()["session_id"]
    try:
        call(http, sid, "run_shell", command="echo 'hello, world' > hello.txt")
        g = http.post(f"/sessions/{sid}/grade").json()
        assert g["reward"] == 1.0 and g["reward_details"] == {"files_checked": 1}
        assert "+++ b/hello.txt" in g["diff"]
        listing = call(http, sid, "list_dir")["result"]["entries"]
        assert sorted(e["path"] for e in listing) == ["/app/README.md", "/app/hello.txt"]
    finally:
        http.delete(f"/sessions/{sid}")


@pytest.mark.parametrize(
    "body,code,fragment",
    [
        ({"task_id": "nope"}, 404, "unknown task_id 'nope'"),
        ({"task_id": "gpu-task"}, 409, "gpus = 1"),
        ({"task_id": "needs-docker"}, 409, "Dockerfile"),
        ({"task_id": "fix-add", "seed": -1}, 400, "seed"),
        ({"task_id": "fix-add", "colour": "red"}, 400, "colour"),
        ({}, 400, "task_id: Field required"),
    ],
)
def test_create_errors(http, body, code, fragment):
    r = http.post("/sessions", json=body)
    assert r.status_code == code, r.text
    assert fragment in r.json()["error"]["message"]


def test_request_errors(http, session):
    r = http.post(f"/sessions/{session}/tools", content=b'{"calls": [', headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "malformed_json"
    r = http.post(f"/sessions/{session}/tools", json={"calls": [{"name": "rm_rf", "arguments": {}}]})
    assert r.status_code == 400 and "accepted tools: read_file" in r.json()["error"]["message"]
    r = http.post(f"/sessions/{session}/tools", json={"calls": [{"name": "read_file", "arguments": {"path": 3}}]})
    assert r.status_code == 400 and "'path' = 3 must be of type string" in r.json()["error"]["message"]
    r = http.post(f"/sessions/{session}/tools", json={"calls": [{"name": "read_file", "arguments": {}}]})
    assert "missing required argument(s) ['path']" in r.json()["error"]["message"]
    r = http.post("/sessions/doesnotexist/tools", json={"calls": [{"name": "list_dir", "arguments": {}}]})
    assert r.status_code == 404 and r.json()["error"]["code"] == "session_not_found"
    r = http.post(
        f"/sessions/{session}/tools", content=b"x" * (5 * 2**20), headers={"content-type": "application/json"}
    )
    assert r.status_code == 413
    assert httpx.get(http.base_url.join("/tasks")).status_code == 401
    assert httpx.get(http.base_url.join("/tasks"), headers={"Authorization": "Bearer wrong"}).status_code == 401
    # a tool error is a result, not a request failure, and the other calls still run
    r = http.post(
        f"/sessions/{session}/tools",
        json={
            "calls": [
                {"name": "edit_file", "arguments": {"path": "calc.py", "old_string": "return", "new_string": "yield"}},
                {"name": "read_file", "arguments": {"path": "calc.py", "start_line": 1, "end_line": 1}},
            ]
        },
    )
    first, second = r.json()["results"]
    assert not first["ok"] and "occurs 2 times" in first["error"] and "[6, 11]" in first["error"]
    assert second["ok"] and second["result"]["content"] == '"""A tiny calculator."""\n'


def test_openapi_schema(http):
    schema = http.get("/openapi.json").json()
    assert {"/sessions", "/sessions/{session_id}/tools", "/sessions/{session_id}/grade", "/health", "/metrics"} <= set(
        schema["paths"]
    )
    assert "HTTPBearer" in schema["components"]["securitySchemes"]


def test_capacity_429_and_ttl():
    server = LiveServer("--max-sessions", "2", "--session-ttl", "1")
    try:
        with server.client() as http:
            ids = [http.post("/sessions", json={"task_id": "write-hello"}).json()["session_id"] for _ in range(2)]
            r = http.post("/sessions", json={"task_id": "write-hello"})
            assert r.status_code == 429 and r.headers["retry-after"] == "1"
            assert "limit of 2 concurrent sessions" in r.json()["error"]["message"]
            deadline = time.monotonic() + 15  # TTL 1 s, reaper every 5 s
            while time.monotonic() < deadline and http.get("/health").json()["sessions"]:
                time.sleep(0.5)
            assert http.get("/health").json()["sessions"] == 0
            assert http.get(f"/sessions/{ids[0]}").status_code == 404
            assert scrape(http)("cj_env_sessions_closed_total", reason="ttl") == 2
    finally:
        server.stop()


def test_metrics_scrape(server, http):
    """/metrics read with prometheus_client's own parser: families, types, label sets, and counts
    that moved by exactly what was done between two scrapes (the session, its tool calls, the
    sandboxed commands, one killed at its timeout, one running during a scrape, a grade, a 401)."""
    before = scrape(http)
    sid = http.post("/sessions", json={"task_id": "fix-add"}).json()["session_id"]
    assert call(http, sid, "run_shell", command="echo hi")["result"]["stdout"] == "hi\n"
    assert call(http, sid, "run_shell", command="sleep 5", timeout_s=0.3)["result"]["timed_out"] is True
    assert call(http, sid, "read_file", path="calc.py")["ok"]
    assert not call(http, sid, "read_file", path="missing.py")["ok"]
    slow = threading.Thread(target=call, args=(http, sid, "run_shell"), kwargs={"command": "sleep 1.5"})
    slow.start()
    deadline, running, polls = time.monotonic() + 10, 0.0, 0
    while running < 1 and time.monotonic() < deadline:
        time.sleep(0.05)
        running, polls = scrape(http)("cj_env_sandboxes_running"), polls + 1
    slow.join(30)
    assert running == 1  # the sleep, seen by a scrape while it ran
    assert httpx.get(server.url + "/metrics").status_code == 401  # the token is needed, as before
    after = scrape(http)

    assert {
        "cj_env_sessions_active": "gauge",
        "cj_env_sessions_created": "counter",
        "cj_env_sessions_closed": "counter",
        "cj_env_sessions_rejected": "counter",
        "cj_env_tool_calls": "counter",
        "cj_env_tool_call_seconds": "histogram",
        "cj_env_grades": "counter",
        "cj_env_grade_seconds": "histogram",
        "cj_env_session_create_seconds": "histogram",
        "cj_env_http_requests": "counter",
        "cj_env_sandboxes_running": "gauge",
        "cj_env_sandboxes_created": "counter",
        "cj_env_sandboxes_failed": "counter",
        "cj_env_sandboxes_killed": "counter",
        "cj_env_environments": "gauge",
        "cj_env_environment_builds": "counter",
    }.items() <= after.types.items()
    assert after.labels["cj_env_tool_calls_total"] == {("outcome", "tool")}
    assert after.labels["cj_env_tool_call_seconds_bucket"] == {("le", "tool")}
    assert after.labels["cj_env_http_requests_total"] == {("code",)}
    assert after.delta(before, "cj_env_sessions_created_total") == 1
    assert after.delta(before, "cj_env_sessions_active") == 1
    assert after.delta(before, "cj_env_session_create_seconds_count") == 1
    assert after.delta(before, "cj_env_tool_calls_total", tool="run_shell", outcome="ok") == 3
    assert after.delta(before, "cj_env_tool_calls_total", tool="read_file", outcome="ok") == 1
    assert after.delta(before, "cj_env_tool_calls_total", tool="read_file", outcome="error") == 1
    assert after.delta(before, "cj_env_tool_call_seconds_count", tool="run_shell") == 3
    assert after("cj_env_tool_call_seconds_bucket", tool="run_shell", le="+Inf") == after(
        "cj_env_tool_call_seconds_count", tool="run_shell"
    )
    assert after.delta(before, "cj_env_tool_call_seconds_sum", tool="run_shell") >= 0.3 + 1.5
    assert after.delta(before, "cj_env_sandboxes_created_total") == 3  # one sandbox per run_shell
    assert after.delta(before, "cj_env_sandboxes_killed_total", reason="timeout") == 1
    assert after("cj_env_sandboxes_running") == 0
    # 2xx: the session, five tool calls, the first scrape and the polls (a scrape counts once answered)
    assert after.delta(before, "cj_env_http_requests_total", code="2xx") == 1 + 5 + 1 + polls
    assert after.delta(before, "cj_env_http_requests_total", code="4xx") == 1

    graded = http.post(f"/sessions/{sid}/grade").json()
    assert http.delete(f"/sessions/{sid}").json()["closed"] is True
    done = scrape(http)
    assert graded["reward"] == 0.0
    assert done.delta(after, "cj_env_grades_total") == 1
    assert done.delta(after, "cj_env_grade_seconds_count") == 1
    assert done.delta(after, "cj_env_grade_seconds_sum") == pytest.approx(graded["duration_s"], abs=1e-6)
    assert done.delta(after, "cj_env_sandboxes_created_total") >= 1  # the verifier ran in one
    assert done.delta(after, "cj_env_sessions_closed_total", reason="client") == 1
    assert done("cj_env_sessions_active") == before("cj_env_sessions_active")


def test_server_refuses_to_start_without_sandbox(tmp_path):
    env = env_with_src()
    env["PATH"] = str(tmp_path)  # no bwrap, no prlimit: as on a box without bubblewrap
    r = subprocess.run(
        [sys.executable, "-m", "composer_jax.cli", "env-server", "--tasks", str(FIXTURE_TASKS)],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 2 and "--unsafe-no-sandbox" in r.stderr


def test_importing_server_does_not_import_jax():
    code = (
        "import sys, composer_jax.env.server.app, composer_jax.env.api.client, composer_jax.env.cli; "
        "print('jax' in sys.modules)"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env_with_src(), timeout=60)
    assert r.stdout.strip() == "False", r.stderr


@pytest.mark.parametrize("given", ["--token", "--token-file", "COMPOSER_JAX_ENV_TOKEN", None])
def test_token_is_printed_only_when_generated(tmp_path, given):
    """A token given to the server (flag, file or environment) is the caller's secret and appears
    nowhere in its output, at debug logging, through a run that uses it (header and path form);
    a generated one is printed once, on the startup line. The flag case also names the server
    `env.internal` (--allowed-host), which /mcp then answers to."""
    secret = "given-" + "s3cr3t" * 5
    env, args = env_with_src(), ["--allowed-host", "env.internal"]
    env.pop("COMPOSER_JAX_ENV_TOKEN", None)
    if given == "--token":
        args += ["--token", secret]
    elif given == "--token-file":
        (tmp_path / "token").write_text(secret + "\n")
        args += ["--token-file", str(tmp_path / "token")]
    elif given is not None:
        env[given] = secret
    command = [sys.executable, "-m", "composer_jax.cli", "env-server", "--tasks", str(FIXTURE_TASKS)]
    proc = subprocess.Popen(
        [*command, "--port", "0", "--log-level", "debug", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert proc.stdout is not None
        listening, ready = proc.stdout.readline(), proc.stdout.readline()
        url = json.loads(ready)["url"]
        token = secret if given else listening.split(" token=", 1)[1].strip()
        assert httpx.get(url + "/tasks", headers={"Authorization": f"Bearer {token}"}).status_code == 200
        assert httpx.get(f"{url}/t/{token}/metadata").status_code == 200
        assert httpx.get(url + "/tasks", headers={"Authorization": "Bearer wrong-" + token}).status_code == 401
        ping = {"jsonrpc": "2.0", "id": 1, "method": "ping"}
        for host, expected in (("env.internal", 200), ("evil.example", 403)):
            headers = {"Authorization": f"Bearer {token}", "Host": f"{host}:{url.rsplit(':', 1)[1]}"}
            assert httpx.post(url + "/mcp", json=ping, headers=headers).status_code == expected, host
    finally:
        proc.terminate()
        out, err = proc.communicate(timeout=30)
    printed = listening + ready + out + err
    if given:
        assert secret not in printed and "token=" not in listening, printed
    else:
        assert printed.count(token) == 1 and listening.rstrip().endswith(f"token={token}")
