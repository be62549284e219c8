"""Error types of the environment server, raised where the condition arises.

The HTTP API (`server.py`) maps each type to a status code in one table, the OpenEnv WebSocket
endpoint (`openenv_ws.py`) to an OpenEnv error code and MCP (`mcp.py`) to a JSON-RPC error code,
so no caller has to read an error's message to know what went wrong. Errors of a tool call
(`ToolArgumentError`, `ToolError`) belong to the tool protocol: see `protocol.py`.
"""

from __future__ import annotations


class TaskError(ValueError):
    """A task directory or task id that cannot be used; the message names the bad value."""


class UnknownTaskError(TaskError):
    """No task directory and no generated task family has this id (HTTP 404)."""


class TaskNotRunnable(RuntimeError):
    """The task exists but the local sandbox cannot run it; the message says why."""


class CapacityError(RuntimeError):
    """The server holds `max_sessions` sessions already (HTTP 429; retry later or elsewhere)."""


class SessionBusy(RuntimeError):
    """The session is being graded: tool calls (and a second grade) wait for it (HTTP 409)."""


class SessionNotFound(KeyError):
    """No open session with this id (never existed, closed, or expired)."""

    def __str__(self) -> str:
        return f"no open session {self.args[0]!r} (it may have been closed or expired after its TTL)"
