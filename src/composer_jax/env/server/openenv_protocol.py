"""What OpenEnv clients exchange with this server: actions, observations, MCP tool shapes, schemas.

OpenEnv (`openenv-core` 0.3, `openenv` 0.10) drives an environment with `reset`/`step`/`state` over
a WebSocket (`openenv_ws.py`) and calls tools over MCP JSON-RPC (`mcp.py`). This module holds the
message shapes both use, so they cannot drift, and the JSON schemas `GET /schema` publishes.

A step's action is one of

    {"tool_calls": [{"id"?, "name", "arguments"}, ...]}   this server's own: several calls, in parallel
    {"name", "arguments", "id"?}                           one call (the OpenAI shape is accepted too)
    {"submit": true}                                       grade the workspace: reward set, done
    {"type": "list_tools"}                                 OpenEnv's ListToolsAction
    {"type": "call_tool", "tool_name", "arguments"}        OpenEnv's CallToolAction

A model's bad call (an unknown tool, wrong arguments, an action of no known shape) is an
observation the agent sees, never a protocol error: an RL loop must not die on a made-up tool name.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable
from typing import Any

from composer_jax.env.api import protocol

# OpenEnv's ToolErrorType values (openenv.core.env_server.mcp_types) for CallToolObservation.error.
TOOL_NOT_FOUND = "tool_not_found"
INVALID_ARGS = "invalid_args"
EXECUTION_ERROR = "execution_error"

NOT_AN_ACTION = (
    'not an action of this server; accepted: {"tool_calls": [...]}, {"name", "arguments"}, '
    '{"submit": true}, {"type": "list_tools"}, {"type": "call_tool", "tool_name", "arguments"}'
)
MAX_CALLS_PER_STEP = 64  # as POST /sessions/{id}/tools
EPISODE_DONE = "the episode is done (it was submitted); send reset to start another"

METADATA = {
    "name": "composer_jax-env",
    "description": (
        "Sandboxed coding workspaces (Harbor-format tasks) with six tools: read_file, edit_file, "
        "list_dir, grep, semantic_search, run_shell (plus web_search and read_page where the server and "
        "task offer them). Submit to run the task's hidden tests: reward 0-1."
    ),
    "version": "1.0",
    "author": "composer_jax",
    "readme_content": None,
    "documentation_url": None,
}


# ---------------------------------------------------------------------------- tools in MCP shape
def mcp_tools(schema_key: str = "input_schema", names: Iterable[str] | None = None) -> list[dict]:
    """The tools `names` (default all) as MCP tool specs: `input_schema` in OpenEnv's observations
    (its `Tool` model), `inputSchema` (MCP's spelling) in JSON-RPC `tools/list` results; both
    clients read either."""
    return [
        {
            "name": s["function"]["name"],
            "description": s["function"]["description"],
            schema_key: s["function"]["parameters"],
        }
        for s in protocol.tool_schemas(names)
    ]


def call_tool_result(outcome: dict) -> dict:
    """A call's outcome ({"ok", "result"} or {"ok": false, "error"}) as the CallToolResult OpenEnv
    serialises (FastMCP's fields): `data` is what `MCPToolClient.call_tool` returns, the tool's
    result or {"error": message}; `content` is the same as JSON text, as the agent's tool message."""
    body = outcome["result"] if outcome["ok"] else {"error": outcome["error"]}
    return {
        "content": [{"type": "text", "text": json.dumps(body, ensure_ascii=False)}],
        "structured_content": body,
        "meta": None,
        "data": body,
        "is_error": not outcome["ok"],
    }


def call_tool_observation(tool_name: Any, result: dict | None, error: tuple[str, str] | None = None) -> dict:
    """OpenEnv's CallToolObservation body: the tool's result (its own failures included, with
    is_error), or `error` = (error type, message) for a call that never reached a tool."""
    return {
        "tool_name": tool_name if isinstance(tool_name, str) else str(tool_name),
        "result": result,
        "error": None if error is None else {"error_type": error[0], "message": error[1]},
        "metadata": {},
    }


def bad_call_error(exc: protocol.ToolArgumentError) -> tuple[str, str]:
    kind = TOOL_NOT_FOUND if isinstance(exc, protocol.UnknownToolError) else INVALID_ARGS
    return kind, str(exc)


# ---------------------------------------------------------------------------- actions
def split_calls(action: Any, offered: Collection[str] | None = None) -> list[tuple[Any, Any, tuple[str, dict] | str]]:
    """A step's {"tool_calls"} or {"name", "arguments"} action -> [(id, name, parsed)] in call order,
    `parsed` the checked (name, arguments) or the error message for that call. An action of no
    known shape gives one entry with NOT_AN_ACTION. `offered`: the session's tools (others are unknown)."""
    if not isinstance(action, dict) or "tool_calls" not in action and "name" not in action:
        return [(None, None, NOT_AN_ACTION)]
    raw = action["tool_calls"] if "tool_calls" in action else [action]
    if not isinstance(raw, list) or not raw:
        return [(None, None, "tool_calls must be a non-empty list of calls {id?, name, arguments}")]
    if len(raw) > MAX_CALLS_PER_STEP:
        return [(None, None, f"{len(raw)} tool_calls in one step; at most {MAX_CALLS_PER_STEP}")]
    out: list[tuple[Any, Any, tuple[str, dict] | str]] = []
    for i, call in enumerate(raw):
        call = protocol.unwrap_call(call)
        if not isinstance(call, dict) or "name" not in call:
            out.append((None, None, f"tool_calls[{i}]: {NOT_AN_ACTION}"))
            continue
        call_id = call.get("id") if isinstance(call.get("id"), str) else None
        try:
            parsed = protocol.parse_call(call["name"], call.get("arguments", {}), offered=offered)
            out.append((call_id, call["name"], parsed))
        except protocol.ToolArgumentError as exc:
            out.append((call_id, call["name"], str(exc)))
    return out


def reset_observation(session: Any) -> dict:
    """What a reset returns. `tools` is in MCP shape (OpenEnv's clients read a reset carrying
    `tools` as a tool listing); `metadata` repeats the episode's facts, as OpenEnv's generic
    observation keeps only `metadata`. The OpenAI-shaped schemas are at GET /tools."""
    facts = {
        "session_id": session.session_id,
        "episode_id": session.episode_id,
        "task_id": session.task.task_id,
        "seed": session.seed,
        "instruction": session.task.instruction,
    }
    return {**facts, "tools": mcp_tools(names=session.tool_names), "metadata": facts}


def state(session: Any) -> dict:
    """OpenEnv's State (episode_id, step_count) and this server's session state."""
    return {**session.state(), "episode_id": session.episode_id, "step_count": session.step_count}


# ---------------------------------------------------------------------------- schemas (GET /schema)
_CALL = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "description": "echoed in the result"},
        "name": {"type": "string", "enum": protocol.TOOL_NAMES},
        "arguments": {"type": ["object", "string"], "description": "an object, or a JSON string of one"},
    },
    "required": ["name"],
}
_RESULT = {
    "type": "object",
    "properties": {
        "id": {"type": ["string", "null"]},
        "name": {"type": ["string", "null"]},
        "ok": {"type": "boolean"},
        "result": {"type": "object", "description": "the tool's result (docs/env_protocol.md lists the shapes)"},
        "error": {"type": "string"},
        "duration_s": {"type": "number"},
    },
    "required": ["id", "name", "ok"],
}
_OBS_COMMON = {
    "done": {"type": "boolean"},
    "reward": {"type": ["number", "null"]},
    "metadata": {"type": "object"},
}

SCHEMAS: dict[str, dict] = {
    "action": {
        "title": "Action",
        "oneOf": [
            {
                "type": "object",
                "properties": {"tool_calls": {"type": "array", "minItems": 1, "items": _CALL}},
                "required": ["tool_calls"],
            },
            _CALL,
            {"type": "object", "properties": {"submit": {"const": True}}, "required": ["submit"]},
            {"type": "object", "properties": {"type": {"const": "list_tools"}}, "required": ["type"]},
            {
                "type": "object",
                "properties": {
                    "type": {"const": "call_tool"},
                    "tool_name": {"type": "string", "enum": protocol.TOOL_NAMES},
                    "arguments": {"type": "object"},
                },
                "required": ["type", "tool_name"],
            },
        ],
    },
    "observation": {
        "title": "Observation",
        "type": "object",
        "description": "one of: results (tool calls), grade (submit), tools (list_tools), tool_name (call_tool)",
        "properties": {
            **_OBS_COMMON,
            "results": {"type": "array", "items": _RESULT},
            "grade": {"type": "object", "description": "POST /sessions/{id}/grade's body"},
            "tools": {"type": "array", "items": {"type": "object"}},
            "tool_name": {"type": "string"},
            "result": {"type": ["object", "null"], "description": "CallToolResult: content, data, is_error"},
            "error": {"type": ["object", "string", "null"]},
        },
    },
    "reset_observation": {
        "title": "ResetObservation",
        "type": "object",
        "properties": {
            **_OBS_COMMON,
            "session_id": {"type": "string"},
            "episode_id": {"type": "string"},
            "task_id": {"type": "string"},
            "seed": {"type": "integer"},
            "instruction": {"type": "string"},
            "tools": {"type": "array", "items": {"type": "object"}},
        },
        "required": ["session_id", "episode_id", "task_id", "seed", "instruction", "tools"],
    },
    "state": {
        "title": "State",
        "type": "object",
        "properties": {
            "episode_id": {"type": "string"},
            "step_count": {"type": "integer"},
            "done": {"type": "boolean"},
            "session_id": {"type": "string"},
            "task_id": {"type": "string"},
            "seed": {"type": "integer"},
            "tool_calls": {"type": "integer"},
            "grades": {"type": "integer"},
            "last_reward": {"type": ["number", "null"]},
        },
        "required": ["episode_id", "step_count"],
    },
}
