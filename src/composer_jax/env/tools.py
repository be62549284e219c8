"""The agent's tools: JSON schemas in the OpenAI function-calling format and their implementations.

Tools: read_file, edit_file, list_dir, grep, semantic_search, run_shell. File tools run in the
server against the confined `Workspace`; run_shell runs in the session's sandbox. A tool failure
the agent caused (missing file, ambiguous edit, bad regex) is a *result* with `ok: false` and an
`error` message, so one bad call does not void the others in the same request; a call that does
not match its schema (unknown tool, missing or mistyped argument) is rejected before anything
runs, as a 400 for the whole request.
"""
from __future__ import annotations

import asyncio
import fnmatch
import time
from typing import Any, Awaitable, Callable, Protocol

import regex  # the `regex` module: like `re`, plus a timeout that stops catastrophic backtracking

from composer_jax.env import semantic_search as _semantic
from composer_jax.env.sandbox import ExecResult
from composer_jax.env.workspace import ToolError, Workspace

MAX_READ_LINES = 2000
MAX_TOOL_OUTPUT = 256 * 1024
GREP_REGEX_TIMEOUT_S = 2.0


class ToolArgumentError(ValueError):
    """A call that does not match the tool's schema; the whole request is rejected (HTTP 400)."""


class ToolContext(Protocol):
    workspace: Workspace

    async def run_shell(self, command: str, timeout_s: float) -> ExecResult: ...


def _fn(name: str, description: str, properties: dict, required: list[str]) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "properties": properties, "required": required,
                       "additionalProperties": False}}}


_PATH = {"type": "string", "description": "path relative to /app, or absolute under /app"}

TOOL_SCHEMAS: list[dict] = [
    _fn("read_file", "Read a text file, optionally a range of lines (1-based, inclusive).",
        {"path": _PATH,
         "start_line": {"type": "integer", "minimum": 1, "description": "first line (default 1)"},
         "end_line": {"type": "integer", "minimum": 1, "description": f"last line (default: start_line + {MAX_READ_LINES - 1})"}},
        ["path"]),
    _fn("edit_file", "Edit a file by exact search/replace (old_string must occur exactly once unless "
        "replace_all), or create/overwrite the whole file when old_string is omitted.",
        {"path": _PATH,
         "old_string": {"type": "string", "description": "exact text to replace; omit to write the whole file"},
         "new_string": {"type": "string", "description": "replacement text, or the whole file's content"},
         "replace_all": {"type": "boolean", "description": "replace every occurrence (default false)"}},
        ["path", "new_string"]),
    _fn("list_dir", "List a directory's entries (type and size), recursively to a depth.",
        {"path": {**_PATH, "description": "directory (default /app)"},
         "depth": {"type": "integer", "minimum": 1, "maximum": 5, "description": "levels (default 1)"}},
        []),
    _fn("grep", "Search file contents with a regular expression (Python syntax); returns matching lines.",
        {"pattern": {"type": "string", "description": "regular expression"},
         "path": {**_PATH, "description": "file or directory to search (default /app)"},
         "glob": {"type": "string", "description": "only files whose name or path matches, e.g. '*.py'"},
         "case_insensitive": {"type": "boolean"},
         "max_matches": {"type": "integer", "minimum": 1, "maximum": 1000, "description": "default 100"}},
        ["pattern"]),
    _fn("semantic_search", "Find the code chunks most relevant to a natural-language query, ranked.",
        {"query": {"type": "string"},
         "path": {**_PATH, "description": "directory to search (default /app)"},
         "top_k": {"type": "integer", "minimum": 1, "maximum": 50, "description": "default 8"}},
        ["query"]),
    _fn("run_shell", "Run a bash command in the sandbox with cwd /app (no network). Returns exit code, "
        "stdout and stderr (each capped); the command is killed after timeout_s.",
        {"command": {"type": "string"},
         "timeout_s": {"type": "number", "exclusiveMinimum": 0, "maximum": 600,
                       "description": "wall-clock limit in seconds (default 30; capped by the server)"}},
        ["command"]),
]
TOOL_NAMES = [s["function"]["name"] for s in TOOL_SCHEMAS]
_SCHEMA_BY_NAME = {s["function"]["name"]: s["function"]["parameters"] for s in TOOL_SCHEMAS}
_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool}


def validate_call(name: Any, arguments: Any) -> dict:
    """Check a call against its schema; returns the arguments or raises ToolArgumentError."""
    if name not in _SCHEMA_BY_NAME:
        raise ToolArgumentError(f"unknown tool {name!r}; accepted tools: {', '.join(TOOL_NAMES)}")
    if not isinstance(arguments, dict):
        raise ToolArgumentError(f"{name}: arguments must be a JSON object, got {type(arguments).__name__}")
    schema = _SCHEMA_BY_NAME[name]
    props = schema["properties"]
    unknown = sorted(set(arguments) - set(props))
    if unknown:
        raise ToolArgumentError(f"{name}: unknown argument(s) {unknown}; accepted: {sorted(props)}")
    missing = [k for k in schema["required"] if k not in arguments]
    if missing:
        raise ToolArgumentError(f"{name}: missing required argument(s) {missing}")
    for key, value in arguments.items():
        spec = props[key]
        want = _TYPES[spec["type"]]
        if isinstance(value, bool) and spec["type"] != "boolean" or not isinstance(value, want):
            raise ToolArgumentError(f"{name}: argument {key!r} = {value!r:.80} must be of type {spec['type']}")
        if "minimum" in spec and value < spec["minimum"] or "maximum" in spec and value > spec["maximum"]:
            raise ToolArgumentError(f"{name}: argument {key!r} = {value!r} must be in "
                                    f"[{spec.get('minimum', '-inf')}, {spec.get('maximum', 'inf')}]")
        if "exclusiveMinimum" in spec and value <= spec["exclusiveMinimum"]:
            raise ToolArgumentError(f"{name}: argument {key!r} = {value!r} must be > {spec['exclusiveMinimum']}")
    return arguments


def _decode(data: bytes, where: str) -> str:
    if b"\x00" in data[:8192]:
        raise ToolError(f"{where} looks binary (contains NUL bytes); use run_shell (e.g. xxd) to inspect it")
    return data.decode("utf-8", "replace")


def read_file(ws: Workspace, path: str, start_line: int = 1, end_line: int | None = None) -> dict:
    data, parts = ws.read_bytes(path)
    where = ws.display(parts)
    lines = _decode(data, where).splitlines(keepends=True)
    if end_line is None:
        end_line = start_line + MAX_READ_LINES - 1
    if end_line < start_line:
        raise ToolError(f"end_line {end_line} is before start_line {start_line}")
    if start_line > max(len(lines), 1):
        raise ToolError(f"{where} has {len(lines)} lines; start_line {start_line} is past the end")
    last = min(end_line, len(lines), start_line + MAX_READ_LINES - 1)
    content = "".join(lines[start_line - 1:last])
    truncated = len(content) > MAX_TOOL_OUTPUT
    return {"path": where, "start_line": start_line, "end_line": last, "total_lines": len(lines),
            "content": content[:MAX_TOOL_OUTPUT], "truncated": truncated or last < min(end_line, len(lines))}


def _line_of(text: str, index: int) -> int:
    return text.count("\n", 0, index) + 1


def edit_file(ws: Workspace, path: str, new_string: str, old_string: str | None = None,
              replace_all: bool = False) -> dict:
    if old_string is None:
        created, parts = ws.write_bytes(path, new_string.encode("utf-8"))
        return {"path": ws.display(parts), "created": created, "replacements": 0,
                "mode": "write", "bytes": len(new_string.encode("utf-8"))}
    if old_string == "":
        raise ToolError("old_string is empty; omit old_string to write the whole file, or give the exact "
                        "text to replace")
    data, parts = ws.read_bytes(path)
    where = ws.display(parts)
    text = _decode(data, where)
    count = text.count(old_string)
    if count == 0:
        hint = ""
        first = old_string.strip().splitlines()[0].strip() if old_string.strip() else ""
        if first and first in text:
            hint = (f"; its first line occurs at line {_line_of(text, text.index(first))}, so the text "
                    "differs further on (check whitespace and indentation)")
        raise ToolError(f"old_string not found in {where}{hint}. Nothing was changed.")
    if count > 1 and not replace_all:
        lines, start = [], 0
        while (i := text.find(old_string, start)) != -1 and len(lines) < 10:
            lines.append(_line_of(text, i))
            start = i + 1
        raise ToolError(f"old_string occurs {count} times in {where} (at lines {lines}); include more "
                        "surrounding context to make it unique, or set replace_all. Nothing was changed.")
    new_text = text.replace(old_string, new_string) if replace_all else text.replace(old_string, new_string, 1)
    ws.write_bytes(path, new_text.encode("utf-8"))
    return {"path": where, "created": False, "replacements": count if replace_all else 1, "mode": "replace",
            "first_changed_line": _line_of(text, text.index(old_string))}


def list_dir(ws: Workspace, path: str = "/app", depth: int = 1, max_entries: int = 1000) -> dict:
    entries, truncated = [], False
    for p, kind, size in ws.list_entries(path, depth):
        if len(entries) >= max_entries:
            truncated = True
            break
        entries.append({"path": p, "type": kind, "size": size})
    return {"path": ws.display(ws.parts(path)), "entries": entries, "truncated": truncated}


def _glob_ok(display_path: str, glob: str | None) -> bool:
    if not glob:
        return True
    name = display_path.rsplit("/", 1)[-1]
    rel = display_path[len("/app/"):]
    return fnmatch.fnmatch(name, glob) or fnmatch.fnmatch(rel, glob) or fnmatch.fnmatch(display_path, glob)


def grep(ws: Workspace, pattern: str, path: str = "/app", glob: str | None = None,
         case_insensitive: bool = False, max_matches: int = 100) -> dict:
    try:
        rx = regex.compile(pattern, regex.IGNORECASE if case_insensitive else 0)
    except regex.error as exc:
        raise ToolError(f"invalid regular expression {pattern!r}: {exc}") from None
    matches, files, truncated = [], 0, False
    deadline = time.monotonic() + 10.0
    for display, data in ws.walk_files(path):
        if not _glob_ok(display, glob) or b"\x00" in data[:8192]:
            continue
        files += 1
        for lineno, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            try:
                hit = rx.search(line[:4096], timeout=GREP_REGEX_TIMEOUT_S)
            except TimeoutError:
                raise ToolError(f"regular expression {pattern!r} took over {GREP_REGEX_TIMEOUT_S}s on one "
                                f"line of {display} (catastrophic backtracking); simplify it") from None
            if hit:
                if len(matches) >= max_matches:
                    truncated = True
                    break
                matches.append({"path": display, "line": lineno, "text": line[:500]})
        if truncated or time.monotonic() > deadline:
            truncated = True
            break
    return {"matches": matches, "files_searched": files, "truncated": truncated}


def semantic_search(ws: Workspace, query: str, path: str = "/app", top_k: int = 8) -> dict:
    files = [(p, d.decode("utf-8", "replace")) for p, d in ws.walk_files(path, max_file_bytes=512 * 1024)
             if b"\x00" not in d[:8192]]
    return _semantic.search(query, files[:5000], top_k)


async def run_shell(ctx: ToolContext, command: str, timeout_s: float = 30.0) -> dict:
    return (await ctx.run_shell(command, timeout_s)).to_dict()


_SYNC_TOOLS: dict[str, Callable[..., dict]] = {
    "read_file": read_file, "edit_file": edit_file, "list_dir": list_dir, "grep": grep,
    "semantic_search": semantic_search,
}


async def call_tool(ctx: ToolContext, name: str, arguments: dict) -> dict:
    """Run one validated call; returns {"ok": True, "result": ...} or {"ok": False, "error": ...}."""
    start = time.monotonic()
    try:
        if name == "run_shell":
            result = await run_shell(ctx, **arguments)
        else:
            # File tools do blocking I/O: run them in threads so calls in one request overlap.
            result = await asyncio.to_thread(_SYNC_TOOLS[name], ctx.workspace, **arguments)
        out = {"ok": True, "result": result}
    except ToolError as exc:
        out = {"ok": False, "error": str(exc)}
    except OSError as exc:
        out = {"ok": False, "error": f"{name}: {exc.strerror or exc}"}
    out["duration_s"] = round(time.monotonic() - start, 4)
    return out


async def call_tools(ctx: ToolContext, calls: list[tuple[str, dict]]) -> list[dict]:
    """Run several validated calls concurrently; results are in the order of `calls`."""
    coros: list[Awaitable[dict]] = [call_tool(ctx, name, args) for name, args in calls]
    return list(await asyncio.gather(*coros))
