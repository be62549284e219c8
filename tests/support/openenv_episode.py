"""Drive a running env server with OpenEnv's own client classes; print what they returned as JSON.

    python tests/support/openenv_episode.py BASE_URL [--bearer TOKEN]

Runs with whichever `openenv` package is importable (OpenEnv 0.3's `openenv-core` or the current
`openenv`), so `test_openenv_clients.py` runs it once per client line, in a subprocess: the two
lines install the same `openenv` package and cannot share one interpreter. BASE_URL is the
path-token form `http://HOST:PORT/t/TOKEN` (the only one OpenEnv 0.3's clients can use), or a
plain URL with `--bearer TOKEN` (0.10's `headers=`). Only the clients' public API is used.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

import openenv
from openenv.core import GenericEnvClient
from openenv.core.env_server.mcp_types import CallToolAction
from openenv.core.mcp_client import MCPToolClient
from pydantic import BaseModel


class Submit(BaseModel):
    """An action object whose `model_dump()` is the server's submit action (both clients' step
    payload for a pydantic action is its model_dump)."""

    submit: bool = True


def dump(value: Any) -> Any:
    if hasattr(value, "model_dump"):
        return value.model_dump(mode="json")
    if hasattr(value, "observation"):  # StepResult
        return {"observation": dump(value.observation), "reward": value.reward, "done": value.done}
    return value


async def generic_episode(url: str, kw: dict) -> dict:
    out: dict[str, Any] = {}
    async with GenericEnvClient(base_url=url, **kw) as env:
        out["reset"] = dump(await env.reset(task_id="fix-add", episode_id="ep-1", not_a_reset_argument=1))
        out["parallel"] = dump(
            await env.step(
                {
                    "tool_calls": [
                        {
                            "id": "c1",
                            "name": "read_file",
                            "arguments": {"path": "calc.py", "start_line": 6, "end_line": 6},
                        },
                        {"id": "c2", "name": "grep", "arguments": {"pattern": "def add"}},
                    ]
                }
            )
        )
        out["list_dir"] = dump(await env.step({"id": "c3", "name": "list_dir", "arguments": {}}))
        out["run_shell"] = dump(await env.step({"id": "c4", "name": "run_shell", "arguments": {"command": "echo hi"}}))
        out["unknown_tool"] = dump(await env.step({"id": "c5", "name": "format_disk", "arguments": {}}))
        out["mixed"] = dump(
            await env.step(
                {
                    "tool_calls": [
                        {"id": "c6", "name": "read_file", "arguments": {"path": "calc.py", "bogus": 1}},
                        {
                            "id": "c7",
                            "name": "read_file",
                            "arguments": {"path": "calc.py", "start_line": 1, "end_line": 1},
                        },
                    ]
                }
            )
        )
        out["not_an_action"] = dump(await env.step({"hello": "world"}))
        out["state"] = dump(await env.state())
        edit = {"path": "calc.py", "old_string": "a - b", "new_string": "a + b"}
        out["edit"] = dump(await env.step({"id": "c8", "name": "edit_file", "arguments": edit}))
        out["submit"] = dump(await env.step({"submit": True}))
        out["after_done"] = dump(await env.step({"id": "c9", "name": "list_dir", "arguments": {}}))
        out["state_after"] = dump(await env.state())
    return out


async def bare_resets(url: str, kw: dict) -> dict:
    async with GenericEnvClient(base_url=url, **kw) as env:
        return {
            "bare": dump(await env.reset()),
            "seed7": dump(await env.reset(seed=7)),
            "seed7_again": dump(await env.reset(seed=7, some_other_env_option="ignored")),
        }


async def mcp_episode(url: str, kw: dict) -> dict:
    out: dict[str, Any] = {}
    async with MCPToolClient(base_url=url, **kw) as env:
        out["reset"] = dump(await env.reset(task_id="fix-add"))
        out["tools"] = [dump(t) for t in await env.list_tools()]
        out["read"] = await env.call_tool("read_file", path="calc.py", start_line=6, end_line=6)
        out["missing_file"] = await env.call_tool("read_file", path="no_such_file.py")
        out["unknown_tool_step"] = dump(await env.step(CallToolAction(tool_name="format_disk", arguments={})))
        try:
            out["unknown_tool_call"] = {"returned": await env.call_tool("format_disk")}
        except RuntimeError as exc:  # 0.3's call_tool raises on an observation's `error`, by design
            out["unknown_tool_call"] = {"raised": str(exc)}
        out["edit"] = await env.call_tool("edit_file", path="calc.py", old_string="a - b", new_string="a + b")
        out["submit"] = dump(await env.step(Submit()))
        out["state"] = dump(await env.state())
    return out


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("base_url")
    parser.add_argument("--bearer", help="send Authorization: Bearer TOKEN (clients with headers=)")
    args = parser.parse_args()
    kw = {"headers": {"Authorization": f"Bearer {args.bearer}"}} if args.bearer else {}
    report = {
        "openenv_file": openenv.__file__,
        "generic": await generic_episode(args.base_url, kw),
        "bare": await bare_resets(args.base_url, kw),
        "mcp": await mcp_episode(args.base_url, kw),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    asyncio.run(main())
