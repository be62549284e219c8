"""The agent's tools: their implementations against a session's workspace and sandbox.

Tools: read_file, edit_file, list_dir, grep, semantic_search, run_shell, and, in sessions offered
them, web_search and read_page (their backend: `env/tools/web_search.py`). Their names, schemas,
argument checks and result shapes are the tool protocol (`env/api/protocol.py`, shared with SFT data
generation and the RL loop); this module does the I/O. File tools run in the
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
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import regex  # the `regex` module: like `re`, plus a timeout that stops catastrophic backtracking

from composer_jax.env.api import protocol
from composer_jax.env.api.protocol import ToolError
from composer_jax.env.sandbox.runner import ExecResult
from composer_jax.env.sandbox.workspace import Workspace
from composer_jax.env.tools import semantic_search as _semantic
from composer_jax.env.tools.web_search import Backend

GREP_REGEX_TIMEOUT_S = 2.0


class ToolContext(Protocol):
    workspace: Workspace
    web: Backend | None  # the web tools' backend, None when the session is not offered them

    async def run_shell(self, command: str, timeout_s: float) -> ExecResult: ...


def _decode(data: bytes, where: str) -> str:
    if b"\x00" in data[:8192]:
        raise ToolError(f"{where} looks binary (contains NUL bytes); use run_shell (e.g. xxd) to inspect it")
    return data.decode("utf-8", "replace")


def read_file(ws: Workspace, path: str, start_line: int = 1, end_line: int | None = None) -> dict:
    data, parts = ws.read_bytes(path)
    where = ws.display(parts)
    return protocol.read_file_result(where, _decode(data, where), start_line, end_line)


def edit_file(
    ws: Workspace, path: str, new_string: str, old_string: str | None = None, replace_all: bool = False
) -> dict:
    if old_string is None:
        created, parts = ws.write_bytes(path, new_string.encode("utf-8"))
        return protocol.edit_file_write_result(ws.display(parts), created, new_string)
    protocol.check_old_string(old_string)  # before reading: the refusal does not depend on the file
    data, parts = ws.read_bytes(path)
    where = ws.display(parts)
    new_text, result = protocol.edit_file_replace(where, _decode(data, where), old_string, new_string, replace_all)
    ws.write_bytes(path, new_text.encode("utf-8"))
    return result


def list_dir(ws: Workspace, path: str = "/app", depth: int = 1, max_entries: int = protocol.MAX_LIST_ENTRIES) -> dict:
    return protocol.list_dir_result(ws.display(ws.parts(path)), ws.list_entries(path, depth), max_entries)


def _glob_ok(display_path: str, glob: str | None) -> bool:
    if not glob:
        return True
    name = display_path.rsplit("/", 1)[-1]
    rel = display_path[len("/app/") :]
    return fnmatch.fnmatch(name, glob) or fnmatch.fnmatch(rel, glob) or fnmatch.fnmatch(display_path, glob)


def grep(
    ws: Workspace,
    pattern: str,
    path: str = "/app",
    glob: str | None = None,
    case_insensitive: bool = False,
    max_matches: int = 100,
) -> dict:
    try:
        rx = regex.compile(pattern, regex.IGNORECASE if case_insensitive else 0)
    except regex.error as exc:
        raise ToolError(f"invalid regular expression {pattern!r}: {exc}") from None
    matches: list[dict[str, Any]] = []
    files, truncated = 0, False
    deadline = time.monotonic() + 10.0
    for display, data in ws.walk_files(path):
        if not _glob_ok(display, glob) or b"\x00" in data[:8192]:
            continue
        files += 1
        for lineno, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
            try:
                hit = rx.search(line[:4096], timeout=GREP_REGEX_TIMEOUT_S)
            except TimeoutError:
                raise ToolError(
                    f"regular expression {pattern!r} took over {GREP_REGEX_TIMEOUT_S}s on one "
                    f"line of {display} (catastrophic backtracking); simplify it"
                ) from None
            if hit:
                if len(matches) >= max_matches:
                    truncated = True
                    break
                matches.append(protocol.grep_match(display, lineno, line))
        if truncated or time.monotonic() > deadline:
            truncated = True
            break
    return protocol.grep_result(matches, files, truncated)


def semantic_search(ws: Workspace, query: str, path: str = "/app", top_k: int = 8) -> dict:
    files = [
        (p, d.decode("utf-8", "replace"))
        for p, d in ws.walk_files(path, max_file_bytes=512 * 1024)
        if b"\x00" not in d[:8192]
    ]
    return _semantic.search(query, files[:5000], top_k)


def web_search(web: Backend, query: str, top_k: int = 5) -> dict:
    return protocol.web_search_result(web.name, query, web.search(query, top_k))


def read_page(web: Backend, url: str, offset: int = 0) -> dict:
    return web.read(url, offset)


_WEB_TOOLS: dict[str, Callable[..., dict]] = {"web_search": web_search, "read_page": read_page}


async def run_shell(ctx: ToolContext, command: str, timeout_s: float = 30.0) -> dict:
    r = await ctx.run_shell(command, timeout_s)
    return protocol.run_shell_result(r.exit_code, r.stdout, r.stderr, r.timed_out, r.truncated, r.duration_s)


_SYNC_TOOLS: dict[str, Callable[..., dict]] = {
    "read_file": read_file,
    "edit_file": edit_file,
    "list_dir": list_dir,
    "grep": grep,
    "semantic_search": semantic_search,
}


async def call_tool(ctx: ToolContext, name: str, arguments: dict) -> dict:
    """Run one validated call; returns {"ok": True, "result": ...} or {"ok": False, "error": ...}."""
    start = time.monotonic()
    try:
        if name == "run_shell":
            result = await run_shell(ctx, **arguments)
        elif name in _WEB_TOOLS:
            if ctx.web is None:  # the server checks the session's tools first; this is a backstop
                raise ToolError(f"{name} is not offered in this session")
            # blocking: the index build or load (first call), or the network
            result = await asyncio.to_thread(_WEB_TOOLS[name], ctx.web, **arguments)
        else:
            # File tools do blocking I/O: run them in threads so calls in one request overlap.
            result = await asyncio.to_thread(_SYNC_TOOLS[name], ctx.workspace, **arguments)
        out = protocol.call_outcome(result)
    except ToolError as exc:
        out = protocol.call_outcome(error=str(exc))
    except OSError as exc:
        out = protocol.call_outcome(error=f"{name}: {exc.strerror or exc}")
    out["duration_s"] = round(time.monotonic() - start, 4)
    return out


async def call_tools(ctx: ToolContext, calls: list[tuple[str, dict]]) -> list[dict]:
    """Run several validated calls concurrently; results are in the order of `calls`."""
    coros: list[Awaitable[dict]] = [call_tool(ctx, name, args) for name, args in calls]
    return list(await asyncio.gather(*coros))
