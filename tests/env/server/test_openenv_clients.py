"""Full episodes driven by OpenEnv's own client classes, and `openenv validate --url`.

Both client lines are exercised: the current `openenv` (0.10, pinned in locks/env.lock and
installed in the venv) and OpenEnv 0.3's `openenv-core` (locks/openenv03.lock). The two
install the same `openenv` package, so `make venv` puts 0.3 in its own directory
(`.venv/openenv-0.3`, found through `sys.prefix`) and each line runs `openenv_episode.py` in its
own interpreter. Expected values are worked by hand from the fixture task `fix-add`
(`calc.py`: `add` on line 4 returns `a - b` on line 6; its three tests pass once that is `a + b`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from support.live_server import FIXTURE_TASKS, env_with_src, requires_bwrap
from websockets.exceptions import WebSocketException
from websockets.sync.client import connect

pytestmark = requires_bwrap

EPISODE = Path(__file__).resolve().parents[2] / "support" / "openenv_episode.py"
TOOLS = ["read_file", "edit_file", "list_dir", "grep", "semantic_search", "run_shell"]
CALC = FIXTURE_TASKS / "fix-add" / "environment" / "app" / "calc.py"
# What a reset without task_id may pick: the runnable fixture tasks or a generated family, never
# gpu-task (asks for a GPU) or needs-docker (no environment/app).
NOT_RUNNABLE = {"gpu-task", "needs-docker"}
OPENENV_03 = Path(os.environ.get("COMPOSER_JAX_OPENENV_03", Path(sys.prefix) / "openenv-0.3"))

try:
    import openenv  # noqa: F401 - the current line, in this interpreter

    HAVE_OPENENV = True
except ImportError:
    HAVE_OPENENV = False
requires_openenv = pytest.mark.skipif(not HAVE_OPENENV, reason="openenv is not installed; `make venv`")


def run_episode(server, line: str, auth: str) -> dict:
    env = env_with_src()
    if line == "0.3":
        if not (OPENENV_03 / "openenv").is_dir():
            pytest.skip(f"OpenEnv 0.3 is not installed at {OPENENV_03}; `make venv` installs it")
        env["PYTHONPATH"] = f"{OPENENV_03}{os.pathsep}{env['PYTHONPATH']}"
    args = [f"{server.url}/t/{server.token}"] if auth == "path" else [server.url, f"--bearer={server.token}"]
    proc = subprocess.run([sys.executable, str(EPISODE), *args], capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads(proc.stdout)
    expected_home = OPENENV_03 if line == "0.3" else Path(sys.prefix)
    assert Path(report["openenv_file"]).resolve().is_relative_to(expected_home.resolve()), report["openenv_file"]
    return report


def check_generic(g: dict) -> None:
    reset = g["reset"]["observation"]
    assert g["reset"]["done"] is False and g["reset"]["reward"] is None
    assert (reset["task_id"], reset["seed"], reset["episode_id"]) == ("fix-add", 0, "ep-1")
    assert "calc.add" in reset["instruction"] and [t["name"] for t in reset["tools"]] == TOOLS
    assert all(t["input_schema"]["type"] == "object" for t in reset["tools"])

    read, grep = g["parallel"]["observation"]["results"]
    assert (read["id"], read["ok"], read["result"]["content"]) == ("c1", True, "    return a - b\n")
    assert grep["id"] == "c2" and grep["result"]["matches"] == [
        {"path": "/app/calc.py", "line": 4, "text": "def add(a, b):"}
    ]
    [listing] = g["list_dir"]["observation"]["results"]
    assert listing["id"] == "c3" and listing["result"]["entries"] == [
        {"path": "/app/calc.py", "type": "file", "size": CALC.stat().st_size}
    ]
    [shell] = g["run_shell"]["observation"]["results"]
    assert shell["id"] == "c4" and shell["result"]["stdout"] == "hi\n" and shell["result"]["exit_code"] == 0

    # a model's bad calls are observations the agent reads, not errors that end the loop
    [unknown] = g["unknown_tool"]["observation"]["results"]
    assert g["unknown_tool"]["done"] is False
    assert (unknown["id"], unknown["name"], unknown["ok"]) == ("c5", "format_disk", False)
    assert "'format_disk'" in unknown["error"] and "read_file, edit_file" in unknown["error"]
    bad_arg, good = g["mixed"]["observation"]["results"]
    assert (bad_arg["id"], bad_arg["ok"]) == ("c6", False) and "'bogus'" in bad_arg["error"]
    assert (good["id"], good["ok"], good["result"]["content"]) == ("c7", True, '"""A tiny calculator."""\n')
    [nonsense] = g["not_an_action"]["observation"]["results"]
    assert nonsense["ok"] is False and '{"submit": true}' in nonsense["error"]

    # the client's episode id throughout; six steps so far (the bad ones count), five calls ran
    state = g["state"]
    assert (state["episode_id"], state["session_id"]) == ("ep-1", reset["session_id"])
    assert (state["step_count"], state["tool_calls"], state["done"]) == (6, 5, False)

    assert g["edit"]["observation"]["results"][0]["result"]["replacements"] == 1
    submit = g["submit"]
    assert (submit["reward"], submit["done"]) == (1.0, True)
    assert [t["outcome"] for t in submit["observation"]["grade"]["tests"]] == ["passed"] * 3
    # after the submit the episode stays done and nothing more runs
    after = g["after_done"]
    assert (after["reward"], after["done"], after["observation"]["results"]) == (1.0, True, [])
    assert "reset" in after["observation"]["error"]
    end = g["state_after"]
    assert (end["step_count"], end["tool_calls"], end["grades"], end["done"]) == (8, 6, 1, True)


def check_bare(b: dict) -> None:
    bare, seven, again = (b[k]["observation"] for k in ("bare", "seed7", "seed7_again"))
    assert isinstance(bare["seed"], int) and bare["task_id"] not in NOT_RUNNABLE
    assert bare["task_id"] in {"fix-add", "write-hello"} or bare["task_id"].startswith("gen/")
    assert (seven["seed"], again["seed"]) == (7, 7) and seven["task_id"] == again["task_id"]
    # a reset starts a new episode in the socket's session (OpenEnv: one session per socket)
    assert bare["session_id"] == seven["session_id"] == again["session_id"]
    assert bare["episode_id"] == bare["session_id"]  # no episode_id given: the session's id


def check_mcp(m: dict, line: str) -> None:
    assert m["reset"]["observation"]["metadata"]["task_id"] == "fix-add"
    assert [t["name"] for t in m["tools"]] == TOOLS and m["tools"][0]["input_schema"]["required"] == ["path"]
    assert m["read"]["content"] == "    return a - b\n"
    assert m["missing_file"] == {"error": "/app/no_such_file.py: no such file"}
    step = m["unknown_tool_step"]
    assert step["done"] is False and step["observation"]["error"]["error_type"] == "tool_not_found"
    if line == "0.3":  # its call_tool raises on an observation's error, by its own design
        assert "tool_not_found" in m["unknown_tool_call"]["raised"]
    else:  # 0.10 calls over /mcp: the error is a result
        assert "unknown tool 'format_disk'" in m["unknown_tool_call"]["returned"]["error"]
    assert m["edit"]["replacements"] == 1
    assert (m["submit"]["reward"], m["submit"]["done"]) == (1.0, True)
    # read, missing, unknown (step), unknown (call), edit, submit; list_tools is not a step
    assert m["state"]["step_count"] == 6


def assert_no_sessions_left(server) -> None:
    deadline = time.monotonic() + 10
    while httpx.get(server.url + "/health").json()["sessions"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert httpx.get(server.url + "/health").json()["sessions"] == 0


@requires_openenv
@pytest.mark.parametrize(
    ("line", "auth"),
    [("0.3", "path"), ("0.10", "path"), ("0.10", "bearer")],
    ids=["openenv-core-0.3-path-token", "openenv-0.10-path-token", "openenv-0.10-bearer-header"],
)
def test_full_episode_with_openenv_clients(server, line, auth):
    report = run_episode(server, line, auth)
    check_generic(report["generic"])
    check_bare(report["bare"])
    check_mcp(report["mcp"], line)
    assert_no_sessions_left(server)  # every client closed its session


@requires_openenv
def test_openenv_validate_url_passes_all_criteria(server):
    cli = Path(sys.executable).with_name("openenv")
    proc = subprocess.run(
        [str(cli), "validate", "--url", f"{server.url}/t/{server.token}", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert (report["summary"]["passed_count"], report["summary"]["total_count"]) == (6, 6)
    assert report["mode"] == "production"  # no /reset, /step, /state HTTP routes: sessions are on /ws
    # Without the token only /health answers (the validator would see 401s, as any stranger does).
    for path in ("/metadata", "/schema", "/openapi.json"):
        assert httpx.get(server.url + path).status_code == 401
    assert httpx.post(server.url + "/mcp", json={}).status_code == 401


def test_auth_forms(server):
    """The bearer header (HTTP, and OpenEnv 0.10's `headers=`) and the path form `/t/TOKEN/...`
    (every endpoint; OpenEnv 0.3's clients and `openenv validate`) are accepted; `?token=` is
    not (OpenEnv 0.3 appends `/ws` after it, and a token in a query string leaks into logs)."""
    assert httpx.get(f"{server.url}/tasks", headers=server.headers).status_code == 200
    assert httpx.get(f"{server.url}/t/{server.token}/tasks").status_code == 200
    assert httpx.get(f"{server.url}/t/{server.token}/openapi.json").json()["info"]["version"] == "1.0"
    assert httpx.get(f"{server.url}/t/wrong-token-0123456789/tasks").status_code == 401
    assert httpx.get(f"{server.url}/tasks?token={server.token}").status_code == 401
    ws = server.url.replace("http://", "ws://")
    for url, headers in [(f"{ws}/ws", server.headers), (f"{ws}/t/{server.token}/ws", {})]:
        with connect(url, additional_headers=headers) as sock:
            sock.send(json.dumps({"type": "step", "data": {"type": "list_tools"}}))
            assert [t["name"] for t in json.loads(sock.recv(timeout=30))["data"]["observation"]["tools"]] == TOOLS
    for url in (f"{ws}/ws?token={server.token}", f"{ws}/t/wrong-token-0123456789/ws", f"{ws}/ws"):
        with pytest.raises(WebSocketException):  # the handshake is refused
            with connect(url) as sock:
                sock.recv(timeout=10)
