"""The tool protocol (env/protocol.py): light to import, schemas and argument checks, and SFT tool
results shaped exactly like the server's results for the same calls."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from composer_jax.env.api import protocol
from composer_jax.env.api.protocol import ToolArgumentError, UnknownToolError
from composer_jax.env.sandbox.runner import ExecResult
from composer_jax.env.sandbox.workspace import Workspace
from composer_jax.env.tools import agent_tools as tools

TESTS = Path(__file__).resolve().parents[2]
FIXTURE_TASKS, SFT_TASKS = TESTS / "env" / "fixtures" / "tasks", TESTS / "data" / "fixtures" / "tasks"

SAMPLES = {
    "read_file": {"path": "calc.py", "start_line": 2, "end_line": 5},
    "edit_file": {"path": "/app/calc.py", "old_string": "a - b", "new_string": "a + b", "replace_all": False},
    "list_dir": {"path": "/app", "depth": 2},
    "grep": {"pattern": r"def \w+", "path": "/app", "glob": "*.py", "case_insensitive": True, "max_matches": 10},
    "semantic_search": {"query": "where is addition done", "top_k": 3},
    "web_search": {"query": "compare floats approximately", "top_k": 3},
    "read_page": {"url": "pydoc://pytest.approx", "offset": 0},
    "run_shell": {"command": "echo hi", "timeout_s": 2.5},
}


def test_protocol_imports_without_jax_or_server_dependencies():
    code = (
        "import sys; import composer_jax.env.api.protocol; "
        "heavy = [m for m in ('jax', 'fastapi', 'pydantic', 'regex', 'numpy') if m in sys.modules]; "
        "assert not heavy, heavy"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS.parent / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_schemas_of_the_tools_accept_sample_arguments():
    base = ["read_file", "edit_file", "list_dir", "grep", "semantic_search", "run_shell"]
    assert list(protocol.BASE_TOOL_NAMES) == base and protocol.WEB_TOOL_NAMES == ("web_search", "read_page")
    assert protocol.TOOL_NAMES == base[:5] + ["web_search", "read_page", "run_shell"]
    for schema in protocol.TOOL_SCHEMAS:
        name, params = schema["function"]["name"], schema["function"]["parameters"]
        sample = SAMPLES[name]
        assert schema["type"] == "function" and params["type"] == "object" and not params["additionalProperties"]
        assert set(params["required"]) <= set(sample) <= set(params["properties"])
        assert protocol.validate_call(name, sample) == sample
        # the OpenAI wire form (arguments as a JSON string, call wrapped in "function") parses the same
        wire = {"id": "c1", "type": "function", "function": {"name": name, "arguments": json.dumps(sample)}}
        call = protocol.unwrap_call(wire)
        assert protocol.parse_call(call["name"], call["arguments"], "calls[0]") == (name, sample)
    assert protocol.parse_call("list_dir", "  ") == ("list_dir", {})  # a blank string is no arguments


def test_system_prompt_names_only_real_tools():
    named = set(re.findall(r"(\w+)\(", protocol.SYSTEM_PROMPT))
    assert named and named <= set(protocol.TOOL_NAMES)


@pytest.mark.parametrize("names", [protocol.BASE_TOOL_NAMES, protocol.TOOL_NAMES, ("read_file",)])
def test_system_prompt_lists_exactly_the_session_tools(names):
    # every tool a session offers, semantic_search included, and none it does not
    assert re.findall(r"(\w+)\(", protocol.system_prompt(names)) == [
        n
        for n in (
            "list_dir",
            "read_file",
            "grep",
            "semantic_search",
            "web_search",
            "read_page",
            "edit_file",
            "run_shell",
        )
        if n in names
    ]
    assert protocol.SYSTEM_PROMPT == protocol.system_prompt(protocol.BASE_TOOL_NAMES)
    with pytest.raises(ValueError, match="no such tools: \\['nope'\\]"):
        protocol.system_prompt(["nope"])


def test_a_tool_the_session_does_not_offer_is_unknown():
    with pytest.raises(
        protocol.UnknownToolError,
        match="tool 'web_search' is not offered in this session; accepted tools: read_file, edit_file",
    ):
        protocol.parse_call("web_search", {"query": "q"}, "calls[0]", offered=protocol.BASE_TOOL_NAMES)
    assert protocol.parse_call("web_search", {"query": "q"}, offered=protocol.TOOL_NAMES) == (
        "web_search",
        {"query": "q"},
    )


@pytest.mark.parametrize(
    "name,arguments,argument,fragment",
    [
        ("read_file", {}, "path", "missing required argument(s) ['path']"),
        ("read_file", {"path": 3}, "path", "argument 'path' = 3 must be of type string"),
        ("read_file", {"path": "x", "start_line": 0}, "start_line", "'start_line' = 0 must be in [1, inf]"),
        ("list_dir", {"depth": True}, "depth", "'depth' = True must be of type integer"),
        ("list_dir", {"colour": 1}, "colour", "unknown argument(s) ['colour']; accepted: ['depth', 'path']"),
        ("grep", {"pattern": "x", "max_matches": 1001}, "max_matches", "must be in [1, 1000]"),
        ("edit_file", {"path": "x", "new_string": "y", "replace_all": "yes"}, "replace_all", "must be of type boolean"),
        ("semantic_search", {"query": "q", "top_k": 2.0}, "top_k", "must be of type integer"),
        ("run_shell", {"command": "ls", "timeout_s": 0}, "timeout_s", "'timeout_s' = 0 must be > 0"),
    ],
)
def test_bad_arguments_name_the_tool_and_the_argument(name, arguments, argument, fragment):
    with pytest.raises(ToolArgumentError) as info:
        protocol.parse_call(name, arguments, "calls[3]")
    exc = info.value
    assert exc.tool == name and exc.argument == argument
    assert str(exc).startswith(f"calls[3]: {name}: ") and fragment in str(exc)


def test_unknown_tools_and_undecodable_arguments():
    with pytest.raises(UnknownToolError, match=r"^calls\[0\]: unknown tool 'rm'; accepted tools: read_file, "):
        protocol.parse_call("rm", {}, "calls[0]")
    with pytest.raises(
        ToolArgumentError, match=r"^calls\[1\] \(grep\): arguments is a string but not valid JSON"
    ) as info:
        protocol.parse_call("grep", '{"pattern": ', "calls[1]")
    assert not isinstance(info.value, UnknownToolError) and info.value.tool == "grep"
    with pytest.raises(ToolArgumentError, match="grep: arguments must be a JSON object, got list"):
        protocol.parse_call("grep", "[1]")


class HostShell:
    """A ToolContext over a plain directory: run_shell as a host process (no sandbox needed here)."""

    def __init__(self, root: Path):
        self.workspace = Workspace(root)

    async def run_shell(self, command: str, timeout_s: float) -> ExecResult:
        start = time.monotonic()
        proc = subprocess.run(
            ["bash", "-c", command], cwd=self.workspace.root, capture_output=True, text=True, timeout=timeout_s
        )
        return ExecResult(proc.returncode, proc.stdout, proc.stderr, False, False, time.monotonic() - start)


def _shape(value):
    """Keys and value types, recursively; a list's shape is the set of its elements' shapes."""
    if isinstance(value, dict):
        return {k: _shape(v) for k, v in value.items()}
    if isinstance(value, list):
        return {json.dumps(_shape(v), sort_keys=True) for v in value}
    return type(value).__name__


def _sft_tasks() -> list[Path]:
    return [p.parent.parent for root in (SFT_TASKS, FIXTURE_TASKS) for p in sorted(root.glob("*/solution/solve.sh"))]


@pytest.mark.parametrize("task_dir", _sft_tasks(), ids=lambda p: f"{p.parent.parent.parent.name}/{p.name}")
def test_sft_tool_results_match_the_server(task_dir, tmp_path):
    from composer_jax.data.sft import run_solution, task_conversation  # builds its results with protocol.py

    messages = task_conversation(task_dir)["messages"]
    assert messages[0] == {"role": "system", "content": protocol.SYSTEM_PROMPT}
    shutil.copytree(task_dir / "environment" / "app", tmp_path / "app")
    ctx = HostShell(tmp_path / "app")
    sft_results = {m["tool_call_id"]: json.loads(m["content"]) for m in messages if m["role"] == "tool"}
    seen = set()
    for m in messages:
        for call in m.get("tool_calls") or ():
            # what the server receives for this call, run by the server's own implementation
            name, args = protocol.parse_call(call["function"]["name"], call["function"]["arguments"])
            outcome = asyncio.run(tools.call_tool(ctx, name, args))
            assert outcome["ok"], outcome
            server, sft = outcome["result"], sft_results[call["id"]]
            assert _shape(sft) == _shape(server), (name, sft, server)
            seen.add(name)
            if name == "run_shell":
                assert {**sft, "duration_s": 0} == {**server, "duration_s": 0}
            else:
                assert sft == server
    assert {"list_dir", "edit_file"} <= seen
    if task_dir.name == "add-docs":
        assert "run_shell" in seen  # the deleted file
    # the SFT calls, replayed on the server, leave the tree the reference solution leaves
    replayed = {
        p.relative_to(tmp_path / "app").as_posix(): p.read_bytes()
        for p in (tmp_path / "app").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }
    assert replayed == run_solution(task_dir)[1]
