"""The agent's tool protocol: tool names and schemas, call checking, result shapes, the system prompt.

One definition, shared by everything that speaks to or about the tools, so they cannot drift:

* the environment server: `env/tools/agent_tools.py` implements each tool and builds its result with the
  functions here (list_dir with `list_dir_entries`, the walk itself); `env/server/app.py` (HTTP),
  `env/server/openenv_protocol.py` (WebSocket steps) and `env/server/mcp.py` (MCP) check calls with `parse_call`;
* SFT data generation (`data/sft.py`): its conversations use `SYSTEM_PROMPT` (the six base tools), `assistant_tool_call`
  and `tool_message`, and build each tool result with the same functions the server uses (its
  list_dir walks the task's initial workspace with `list_dir_entries`), so the model sees at SFT
  time exactly what it sees in RL;
* the RL agent loop, which turns the model's tool calls into server calls and the server's
  results back into messages.

Pure standard library (no JAX, no web framework, no `regex`): `data/` and the RL side import it.

Two kinds of failure:

  ToolArgumentError  the call does not match its schema (unknown tool, missing, unknown or
                     mistyped argument, arguments that are not JSON): it is rejected before
                     anything runs, as a 400 for the whole request.
  ToolError          a well-formed call failed because of what the agent asked (missing file,
                     ambiguous edit, bad regex): a result `{"ok": false, "error": ...}`, and the
                     other calls of the same request still run.
"""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Collection, Iterable, Iterator
from typing import Any

APP = "/app"
MAX_READ_LINES = 2000
MAX_TOOL_OUTPUT = 256 * 1024
MAX_LIST_ENTRIES = 1000
MAX_GREP_LINE_CHARS = 500

# How the system prompt names each tool, in the order it names them. Terse: the stage-3 SFT rows
# (assets/sft/disable_debug.jsonl) must fit train.seq_len 640 with it (tests/rl/test_main_run_config.py).
_PROMPT_PHRASES = {
    "list_dir": "list_dir(path, depth)",
    "read_file": "read_file(path, start_line, end_line)",
    "grep": "grep(pattern, path, glob)",
    "semantic_search": "semantic_search(query)",
    "web_search": "web_search(query) (documentation search)",
    "read_page": "read_page(url)",
    "edit_file": "edit_file(path, new_string, old_string) (search/replace, or write the file without old_string)",
    "run_shell": "run_shell(command)",
}


def system_prompt(tool_names: Iterable[str]) -> str:
    """The agent's system prompt naming exactly `tool_names` (a session's tools)."""
    offered = set(tool_names)
    unknown = sorted(offered - set(_PROMPT_PHRASES))
    if unknown:
        raise ValueError(f"no such tools: {unknown}; accepted: {sorted(_PROMPT_PHRASES)}")
    phrases = [p for name, p in _PROMPT_PHRASES.items() if name in offered]
    listed = phrases[0] if len(phrases) == 1 else ", ".join(phrases[:-1]) + " and " + phrases[-1]
    return (
        "You are a coding agent working in a repository at /app. Use the tools to inspect and change it: "
        f"{listed}. Make the change the user asks for, then summarise what you did."
    )


class ToolError(Exception):
    """An error the agent caused; its message is returned to the agent as the tool result."""


class ToolArgumentError(ValueError):
    """A call that does not match the tool's schema; the whole request is rejected (HTTP 400).

    `tool` and `argument` name the bad call and argument where known (None otherwise)."""

    def __init__(self, message: str, *, tool: Any = None, argument: str | None = None):
        super().__init__(message)
        self.tool, self.argument = tool, argument

    def prefixed(self, where: str) -> ToolArgumentError:
        """The same error (same type, tool and argument) with `where: ` before its message."""
        return type(self)(f"{where}: {self}", tool=self.tool, argument=self.argument)


class UnknownToolError(ToolArgumentError):
    """A call naming a tool that does not exist."""


# ---------------------------------------------------------------------------- schemas
def _fn(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": properties,
                "required": required,
                "additionalProperties": False,
            },
        },
    }


_PATH = {"type": "string", "description": "path relative to /app, or absolute under /app"}

TOOL_SCHEMAS: list[dict] = [
    _fn(
        "read_file",
        "Read a text file, optionally a range of lines (1-based, inclusive).",
        {
            "path": _PATH,
            "start_line": {"type": "integer", "minimum": 1, "description": "first line (default 1)"},
            "end_line": {
                "type": "integer",
                "minimum": 1,
                "description": f"last line (default: start_line + {MAX_READ_LINES - 1})",
            },
        },
        ["path"],
    ),
    _fn(
        "edit_file",
        "Edit a file by exact search/replace (old_string must occur exactly once unless "
        "replace_all), or create/overwrite the whole file when old_string is omitted.",
        {
            "path": _PATH,
            "old_string": {"type": "string", "description": "exact text to replace; omit to write the whole file"},
            "new_string": {"type": "string", "description": "replacement text, or the whole file's content"},
            "replace_all": {"type": "boolean", "description": "replace every occurrence (default false)"},
        },
        ["path", "new_string"],
    ),
    _fn(
        "list_dir",
        "List a directory's entries (type and size), recursively to a depth.",
        {
            "path": {**_PATH, "description": "directory (default /app)"},
            "depth": {"type": "integer", "minimum": 1, "maximum": 5, "description": "levels (default 1)"},
        },
        [],
    ),
    _fn(
        "grep",
        "Search file contents with a regular expression (Python syntax); returns matching lines.",
        {
            "pattern": {"type": "string", "description": "regular expression"},
            "path": {**_PATH, "description": "file or directory to search (default /app)"},
            "glob": {"type": "string", "description": "only files whose name or path matches, e.g. '*.py'"},
            "case_insensitive": {"type": "boolean"},
            "max_matches": {"type": "integer", "minimum": 1, "maximum": 1000, "description": "default 100"},
        },
        ["pattern"],
    ),
    _fn(
        "semantic_search",
        "Find the code chunks most relevant to a natural-language query, ranked.",
        {
            "query": {"type": "string"},
            "path": {**_PATH, "description": "directory to search (default /app)"},
            "top_k": {"type": "integer", "minimum": 1, "maximum": 50, "description": "default 8"},
        },
        ["query"],
    ),
    _fn(
        "web_search",
        "Search documentation (offline: the installed packages' docs; or the web where the server has a "
        "search backend) with a natural-language query; returns ranked results with title, url and snippet.",
        {
            "query": {"type": "string"},
            "top_k": {"type": "integer", "minimum": 1, "maximum": 20, "description": "default 5"},
        },
        ["query"],
    ),
    _fn(
        "read_page",
        "Read a page that web_search returned (its url), as text; long pages come in parts from offset.",
        {
            "url": {"type": "string"},
            "offset": {"type": "integer", "minimum": 0, "description": "first character (default 0)"},
        },
        ["url"],
    ),
    _fn(
        "run_shell",
        "Run a bash command in the sandbox with cwd /app (no network). Returns exit code, "
        "stdout and stderr (each capped); the command is killed after timeout_s.",
        {
            "command": {"type": "string"},
            "timeout_s": {
                "type": "number",
                "exclusiveMinimum": 0,
                "maximum": 600,
                "description": "wall-clock limit in seconds (default 30; capped by the server)",
            },
        },
        ["command"],
    ),
]
TOOL_NAMES = [s["function"]["name"] for s in TOOL_SCHEMAS]
WEB_TOOL_NAMES = ("web_search", "read_page")  # offered per session (env/tools/web_search.py says which)
BASE_TOOL_NAMES = tuple(n for n in TOOL_NAMES if n not in WEB_TOOL_NAMES)  # every session's
SYSTEM_PROMPT = system_prompt(BASE_TOOL_NAMES)


def session_tool_names(web: bool) -> tuple[str, ...]:
    """A session's tools in TOOL_NAMES order: the base six, plus the web tools when `web`."""
    return tuple(TOOL_NAMES) if web else BASE_TOOL_NAMES


_SCHEMA_BY_NAME = {s["function"]["name"]: s["function"]["parameters"] for s in TOOL_SCHEMAS}
_TYPES: dict[str, type | tuple[type, ...]] = {"string": str, "integer": int, "number": (int, float), "boolean": bool}


def tool_schemas(names: Iterable[str] | None = None) -> list[dict]:
    """The schemas of `names` (default: every tool), in TOOL_SCHEMAS order."""
    if names is None:
        return TOOL_SCHEMAS
    wanted = set(names)
    return [s for s in TOOL_SCHEMAS if s["function"]["name"] in wanted]


def schema_names(schemas: Iterable[dict]) -> list[str]:
    """The tool names of OpenAI-shaped schemas (e.g. a session's `tools`)."""
    return [s["function"]["name"] for s in schemas]


# ---------------------------------------------------------------------------- checking calls
def validate_call(name: Any, arguments: Any, offered: Collection[str] | None = None) -> dict:
    """Check a call against its schema; returns the arguments or raises ToolArgumentError.

    `offered`: the tools of the session (default every tool); a tool outside it is unknown."""
    if name not in _SCHEMA_BY_NAME or offered is not None and name not in offered:
        accepted = ", ".join(TOOL_NAMES if offered is None else [n for n in TOOL_NAMES if n in offered])
        if name in _SCHEMA_BY_NAME:
            raise UnknownToolError(
                f"tool {name!r} is not offered in this session; accepted tools: {accepted}", tool=name
            )
        raise UnknownToolError(f"unknown tool {name!r}; accepted tools: {accepted}", tool=name)
    if not isinstance(arguments, dict):
        raise ToolArgumentError(f"{name}: arguments must be a JSON object, got {type(arguments).__name__}", tool=name)
    schema = _SCHEMA_BY_NAME[name]
    props = schema["properties"]
    unknown = sorted(set(arguments) - set(props))
    if unknown:
        raise ToolArgumentError(
            f"{name}: unknown argument(s) {unknown}; accepted: {sorted(props)}", tool=name, argument=unknown[0]
        )
    missing = [k for k in schema["required"] if k not in arguments]
    if missing:
        raise ToolArgumentError(f"{name}: missing required argument(s) {missing}", tool=name, argument=missing[0])
    for key, value in arguments.items():
        spec = props[key]
        want = _TYPES[spec["type"]]
        # bool is a subclass of int in Python, but JSON true is not an integer
        if isinstance(value, bool) and spec["type"] != "boolean" or not isinstance(value, want):
            raise ToolArgumentError(
                f"{name}: argument {key!r} = {value!r:.80} must be of type {spec['type']}", tool=name, argument=key
            )
        if "minimum" in spec and value < spec["minimum"] or "maximum" in spec and value > spec["maximum"]:
            raise ToolArgumentError(
                f"{name}: argument {key!r} = {value!r} must be in "
                f"[{spec.get('minimum', '-inf')}, {spec.get('maximum', 'inf')}]",
                tool=name,
                argument=key,
            )
        if "exclusiveMinimum" in spec and value <= spec["exclusiveMinimum"]:
            raise ToolArgumentError(
                f"{name}: argument {key!r} = {value!r} must be > {spec['exclusiveMinimum']}", tool=name, argument=key
            )
    return arguments


def decode_arguments(arguments: Any, where: str, tool: Any = None) -> Any:
    """Arguments given as a JSON string (the OpenAI wire form) -> the decoded value; others unchanged.

    An empty or blank string means no arguments. A string that is not JSON raises
    ToolArgumentError prefixed with `where`."""
    if not isinstance(arguments, str):
        return arguments
    try:
        return json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError as exc:
        raise ToolArgumentError(f"{where}: arguments is a string but not valid JSON: {exc}", tool=tool) from None


def unwrap_call(call: Any) -> Any:
    """The OpenAI shape {"id", "type": "function", "function": {"name", "arguments"}} -> {"id", "name",
    "arguments"}; a call already in that flat shape (or anything else) is returned unchanged."""
    if isinstance(call, dict) and isinstance(call.get("function"), dict) and "name" not in call:
        fn = call["function"]
        return {"id": call.get("id"), "name": fn.get("name"), "arguments": fn.get("arguments", {})}
    return call


def parse_call(name: Any, arguments: Any, where: str = "", offered: Collection[str] | None = None) -> tuple[str, dict]:
    """One call as received (arguments an object or a JSON string) -> (name, checked arguments).

    Raises ToolArgumentError (UnknownToolError for an unknown name) whose message starts with
    `where` (e.g. "calls[2]") when given. `offered`: as validate_call."""
    args = decode_arguments(arguments, f"{where} ({name})" if where else str(name), tool=name)
    try:
        return name, validate_call(name, args, offered)
    except ToolArgumentError as exc:
        if not where:
            raise
        raise exc.prefixed(where) from None


# ---------------------------------------------------------------------------- results
# Each tool's result dict is built here, by the server's implementation (env/tools/agent_tools.py) and by SFT
# generation alike; docs/env_protocol.md lists the shapes.
def read_file_result(path: str, text: str, start_line: int = 1, end_line: int | None = None) -> dict:
    """read_file of `text` (the file at display path `path`): lines start_line..end_line, at most
    MAX_READ_LINES lines and MAX_TOOL_OUTPUT characters; `truncated` says when it was cut."""
    lines = text.splitlines(keepends=True)
    if end_line is None:
        end_line = start_line + MAX_READ_LINES - 1
    if end_line < start_line:
        raise ToolError(f"end_line {end_line} is before start_line {start_line}")
    if start_line > max(len(lines), 1):
        raise ToolError(f"{path} has {len(lines)} lines; start_line {start_line} is past the end")
    last = min(end_line, len(lines), start_line + MAX_READ_LINES - 1)
    content = "".join(lines[start_line - 1 : last])
    truncated = len(content) > MAX_TOOL_OUTPUT
    return {
        "path": path,
        "start_line": start_line,
        "end_line": last,
        "total_lines": len(lines),
        "content": content[:MAX_TOOL_OUTPUT],
        "truncated": truncated or last < min(end_line, len(lines)),
    }


def _line_of(text: str, index: int) -> int:
    return text.count("\n", 0, index) + 1


def edit_file_write_result(path: str, created: bool, new_string: str) -> dict:
    """edit_file without old_string: the whole file at `path` was written with `new_string`."""
    return {
        "path": path,
        "created": created,
        "replacements": 0,
        "mode": "write",
        "bytes": len(new_string.encode("utf-8")),
    }


def check_old_string(old_string: str) -> None:
    """Refuse an empty old_string (it would match everywhere; omitting it means "write the file")."""
    if old_string == "":
        raise ToolError(
            "old_string is empty; omit old_string to write the whole file, or give the exact text to replace"
        )


def edit_file_replace(
    path: str, text: str, old_string: str, new_string: str, replace_all: bool = False
) -> tuple[str, dict]:
    """edit_file's search/replace on `text` (the file at display path `path`) -> (new text, result).

    old_string must occur exactly once unless replace_all; otherwise ToolError says where it occurs
    (or, when absent, where its first line does), and the caller changes nothing."""
    check_old_string(old_string)
    count = text.count(old_string)
    if count == 0:
        hint = ""
        first = old_string.strip().splitlines()[0].strip() if old_string.strip() else ""
        if first and first in text:
            hint = (
                f"; its first line occurs at line {_line_of(text, text.index(first))}, so the text "
                "differs further on (check whitespace and indentation)"
            )
        raise ToolError(f"old_string not found in {path}{hint}. Nothing was changed.")
    if count > 1 and not replace_all:
        lines: list[int] = []
        start = 0
        while (i := text.find(old_string, start)) != -1 and len(lines) < 10:
            lines.append(_line_of(text, i))
            start = i + 1
        raise ToolError(
            f"old_string occurs {count} times in {path} (at lines {lines}); include more "
            "surrounding context to make it unique, or set replace_all. Nothing was changed."
        )
    new_text = text.replace(old_string, new_string) if replace_all else text.replace(old_string, new_string, 1)
    return new_text, {
        "path": path,
        "created": False,
        "replacements": count if replace_all else 1,
        "mode": "replace",
        "first_changed_line": _line_of(text, text.index(old_string)),
    }


def list_dir_entries(dir_fd: int, base: str, depth: int) -> Iterator[tuple[str, str, int]]:
    """list_dir's walk: (display path, kind, size) for each entry under the open directory `dir_fd`
    (shown as `base`), to `depth` levels: a directory's entries sorted by name, then each
    subdirectory's, never following symlinks. kind is file, dir, symlink or other; size is 0 for
    all but files. The server lists a workspace with it, SFT data a task's initial one."""
    for dirpath, dirnames, filenames, dirfd in os.fwalk(".", dir_fd=dir_fd, follow_symlinks=False):
        level = 0 if dirpath == "." else dirpath.count("/")
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            try:
                st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            except OSError:
                continue  # vanished while listing
            kind = (
                "dir"
                if stat.S_ISDIR(st.st_mode)
                else "symlink"
                if stat.S_ISLNK(st.st_mode)
                else "file"
                if stat.S_ISREG(st.st_mode)
                else "other"
            )
            rel = os.path.normpath(os.path.join(dirpath, name))
            yield f"{base}/{rel}", kind, st.st_size if kind == "file" else 0
        if level + 1 >= depth:
            dirnames[:] = []


def list_dir_result(path: str, entries: Iterable[tuple[str, str, int]], max_entries: int = MAX_LIST_ENTRIES) -> dict:
    """list_dir of directory `path` from (display path, kind, size) entries in listing order; kind
    is file, dir, symlink or other (size 0 for all but files). Stops after `max_entries`."""
    out: list[dict[str, Any]] = []
    truncated = False
    for p, kind, size in entries:
        if len(out) >= max_entries:
            truncated = True
            break
        out.append({"path": p, "type": kind, "size": size})
    return {"path": path, "entries": out, "truncated": truncated}


def grep_match(path: str, line: int, text: str) -> dict:
    """One grep hit: line number `line` (1-based) of `path`, its text cut to MAX_GREP_LINE_CHARS."""
    return {"path": path, "line": line, "text": text[:MAX_GREP_LINE_CHARS]}


def grep_result(matches: list[dict], files_searched: int, truncated: bool) -> dict:
    return {"matches": matches, "files_searched": files_searched, "truncated": truncated}


def search_hit(path: str, start_line: int, end_line: int, score: float, text: str) -> dict:
    """One semantic_search hit: a chunk of `path` (lines start_line..end_line) and its score."""
    return {"path": path, "start_line": start_line, "end_line": end_line, "score": round(score, 4), "text": text}


def semantic_search_result(ranking: str, chunks_searched: int, results: list[dict]) -> dict:
    return {"ranking": ranking, "chunks_searched": chunks_searched, "results": results}


def web_search_result(backend: str, query: str, results: list[dict]) -> dict:
    """web_search: `results` best first, each {title, url, snippet} (the offline backend adds
    `source`, the package, and `score`)."""
    return {"backend": backend, "query": query, "results": results}


def run_shell_result(
    exit_code: int | None, stdout: str, stderr: str, timed_out: bool, truncated: bool, duration_s: float
) -> dict:
    """run_shell: exit_code is None when the command was killed at its timeout; `truncated` says
    output beyond the per-stream cap was dropped."""
    return {
        "exit_code": exit_code,
        "stdout": stdout,
        "stderr": stderr,
        "timed_out": timed_out,
        "truncated": truncated,
        "duration_s": duration_s,
    }


def call_outcome(result: dict | None = None, *, error: str | None = None) -> dict:
    """The server's per-call envelope: {"ok": true, "result"} or {"ok": false, "error"}."""
    return {"ok": True, "result": result} if error is None else {"ok": False, "error": error}


# ---------------------------------------------------------------------------- conversation messages
# OpenAI message format (formats/chatml.py renders it): an assistant turn's `tool_calls`, then one
# `tool` message per call carrying what the server returned.
def assistant_tool_call(call_id: str, name: str, arguments: dict) -> dict:
    """One entry of an assistant message's `tool_calls`; the call is checked against its schema."""
    validate_call(name, arguments)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def tool_message(call_id: str, result: dict | None = None, *, error: str | None = None) -> dict:
    """The `tool` message answering call `call_id`: the call's result as JSON, or {"error": message}
    for a call that failed (an outcome with ok false)."""
    body = {"error": error} if error is not None else result
    return {"role": "tool", "tool_call_id": call_id, "content": json.dumps(body, ensure_ascii=False)}
