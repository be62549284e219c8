"""SFT conversations from Harbor tasks: the reference solution replayed as an agent trajectory.

The tasks are a directory of Harbor tasks: the bundled suite, or seeds of a generated family
written by `composer-jax env generate FAMILY --seeds A:B --out DIR` (e.g. the RL demo's
disable-debug on seeds its RL run and held-out evaluation never use).
A task directory holds instruction.md, environment/app/ (the initial repository) and
solution/solve.sh (+ files it copies). For each task we run solve.sh offline on a temporary copy of
the repository (its `/app` and `/solution` paths rewritten to the copies, under a timeout), diff the
tree before and after, and write one conversation in the tool protocol of the environment server
(composer_jax/env/api/protocol.py):

  system     the agent's role and tools
  user       instruction.md
  assistant  list_dir /app (depth 2)                 -> tool: the real listing
  assistant  read_file on every file the solution changes (parallel calls) -> tool: real contents
  assistant  edit_file per changed file: one search/replace when the change is a single hunk whose
             old text is unique, else the whole new file; run_shell `rm` for deleted files
  assistant  a summary naming the files and line counts changed

Tool results are the JSON the environment server returns for that call (built by the same protocol
functions the server uses), so the model sees at SFT time what it will see in RL. Nothing here is
invented except the short assistant prose.

A mined or imported task (`env/mining/taskwrite.py`) has a solve.sh that runs `git apply
/solution/solution.patch` in /app; that is solved the same way: the patch is applied to the copy
(git's repository discovery stopped at the copy, so a checkout around the temporary directory is
never touched) and each file it changes becomes an edit_file call. The tool protocol edits UTF-8
text only, so a task whose solution changes a binary file is skipped (`make_sft` names it).
"""

from __future__ import annotations

import difflib
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

from composer_jax.config.data import DataConfigError
from composer_jax.env.api import protocol

# `/app` or `/solution` as a path root (not part of a longer word or path)
_ROOT_RE = re.compile(r"(?<![\w./-])/(app|solution)(?=/|\b|$)")


def _snapshot(root: Path) -> dict[str, bytes]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in (".git", "__pycache__", ".pytest_cache"))
        for fn in filenames:
            p = Path(dirpath) / fn
            if p.is_file() and not p.is_symlink():
                out[p.relative_to(root).as_posix()] = p.read_bytes()
    return out


def run_solution(task_dir: Path, *, timeout_s: float = 60.0) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """(files before, files after) of environment/app when solution/solve.sh runs on a copy."""
    app, solution = task_dir / "environment" / "app", task_dir / "solution"
    solve = solution / "solve.sh"
    for need in (task_dir / "instruction.md", app, solve):
        if not need.exists():
            raise DataConfigError(
                f"task {task_dir.name!r}: missing {need.relative_to(task_dir)}; a Harbor task "
                "needs instruction.md, environment/app/ and solution/solve.sh"
            )
    with tempfile.TemporaryDirectory(prefix="cj-sft-") as tmp:
        work, sol = Path(tmp) / "app", Path(tmp) / "solution"
        shutil.copytree(app, work, symlinks=True)
        shutil.copytree(solution, sol, symlinks=True)
        before = _snapshot(work)
        roots = {"app": str(work), "solution": str(sol)}
        script = _ROOT_RE.sub(lambda m: roots[m.group(1)], solve.read_text())
        (Path(tmp) / "solve.sh").write_text(script)
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": tmp,
            "LC_ALL": "C.UTF-8",
            # `git apply` in the copy: no repository above it is found (a git checkout around $TMPDIR
            # would make git apply the paths relative to that checkout's root)
            "GIT_CEILING_DIRECTORIES": tmp,
        }
        try:
            proc = subprocess.run(
                ["bash", str(Path(tmp) / "solve.sh")],
                cwd=work,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout_s,
            )
        except subprocess.TimeoutExpired:
            raise DataConfigError(f"task {task_dir.name!r}: solution/solve.sh ran past {timeout_s}s") from None
        if proc.returncode != 0:
            raise DataConfigError(
                f"task {task_dir.name!r}: solution/solve.sh exited {proc.returncode}: {proc.stderr.strip()[-500:]}"
            )
        return before, _snapshot(work)


class UnrepresentableSolution(DataConfigError):
    """The reference solution changes something the tool protocol cannot write (a binary file)."""


def _text(task: str, rel: str, data: bytes) -> str:
    try:
        if b"\x00" not in data:
            return data.decode("utf-8")
    except UnicodeDecodeError:
        pass
    raise UnrepresentableSolution(
        f"task {task!r}: the solution changes {rel!r}, which is not UTF-8 text; edit_file writes text only"
    )


def _call(call_id: str, name: str, **arguments) -> dict:
    return protocol.assistant_tool_call(call_id, name, arguments)


def _app(rel: str) -> str:
    """The path the server shows for `rel` (relative to the repository root)."""
    return f"{protocol.APP}/{rel}"


def _single_hunk(old: str, new: str) -> tuple[str, str] | None:
    """(old_string, new_string) replacing the one changed region (whole lines, one line of context
    where needed for uniqueness) when `old_string` occurs exactly once in `old`; else None."""
    a, b = old.splitlines(keepends=True), new.splitlines(keepends=True)
    ops = [op for op in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_opcodes() if op[0] != "equal"]
    if not ops:
        return None
    i1, i2, j1, j2 = ops[0][1], ops[-1][2], ops[0][3], ops[-1][4]
    if i2 - i1 > 60 or j2 - j1 > 60:  # big rewrites read better as whole files
        return None
    for ctx in range(0, 4):
        lo, hi = max(i1 - ctx, 0), min(i2 + ctx, len(a))
        old_s = "".join(a[lo:hi])
        new_s = "".join(a[lo:i1] + b[j1:j2] + a[i2:hi])
        if old_s and old.count(old_s) == 1:
            return old_s, new_s
    return None


def task_conversation(task_dir: str | Path, *, timeout_s: float = 60.0) -> dict:
    """One task -> {"task": name, "messages": [...]} (OpenAI message format, see formats/chatml.py)."""
    task_dir = Path(task_dir)
    before, after = run_solution(task_dir, timeout_s=timeout_s)
    changed = sorted(p for p in after if p in before and after[p] != before[p])
    added = sorted(p for p in after if p not in before)
    deleted = sorted(p for p in before if p not in after)
    for p in changed + added:
        _text(task_dir.name, p, after[p])
        if p in before:
            _text(task_dir.name, p, before[p])
    msgs: list[dict] = [
        {"role": "system", "content": protocol.SYSTEM_PROMPT},
        # exactly what the server hands the agent (the file's text, trailing newline included): the
        # tiny model learns the template token for token, and one token off derails it
        {"role": "user", "content": (task_dir / "instruction.md").read_text(encoding="utf-8")},
    ]
    n = 0

    def next_id() -> str:
        nonlocal n
        n += 1
        return f"call_{n}"

    cid = next_id()
    msgs.append(
        {
            "role": "assistant",
            "content": "Let me look at the repository layout first.",
            "tool_calls": [_call(cid, "list_dir", path="/app", depth=2)],
        }
    )
    # What the server returns for this call on a fresh session: its walk over the initial workspace.
    listing = list_initial_workspace(task_dir, depth=2)
    msgs.append(protocol.tool_message(cid, listing))

    to_read = changed + deleted
    if to_read:
        calls = [(next_id(), p) for p in to_read]
        msgs.append(
            {
                "role": "assistant",
                "content": "I'll read the files involved.",
                "tool_calls": [_call(c, "read_file", path=p) for c, p in calls],
            }
        )
        for c, p in calls:
            content = before[p].decode("utf-8", "replace")
            msgs.append(protocol.tool_message(c, protocol.read_file_result(_app(p), content)))
    edits = []
    for p in changed + added:
        c = next_id()
        new = after[p].decode("utf-8", "replace")
        old = before[p].decode("utf-8", "replace") if p in before else None
        hunk = _single_hunk(old, new) if old is not None else None
        if hunk and old is not None:
            # The server's own search/replace: the same result, and proof that the call is valid.
            replaced, result = protocol.edit_file_replace(_app(p), old, hunk[0], hunk[1])
            if replaced != new:  # a bug in _single_hunk; never train on an edit that does not apply
                raise RuntimeError(f"task {task_dir.name!r}: the edit of {p} does not reproduce the solution's file")
            edits.append((c, _call(c, "edit_file", path=p, old_string=hunk[0], new_string=hunk[1]), result))
        else:
            edits.append(
                (
                    c,
                    _call(c, "edit_file", path=p, new_string=new),
                    protocol.edit_file_write_result(_app(p), p not in before, new),
                )
            )
    for p in deleted:
        c = next_id()
        edits.append(
            (
                c,
                _call(c, "run_shell", command=f"rm -- {json.dumps(p)}"),
                protocol.run_shell_result(0, "", "", False, False, 0.0),
            )
        )
    if edits:
        msgs.append(
            {"role": "assistant", "content": "Now I'll make the changes.", "tool_calls": [call for _, call, _ in edits]}
        )
        msgs.extend(protocol.tool_message(c, r) for c, _, r in edits)
    msgs.append({"role": "assistant", "content": _summary(changed, added, deleted, before, after)})
    return {"task": task_dir.name, "messages": msgs}


def list_initial_workspace(task_dir: Path, depth: int) -> dict:
    """list_dir /app to `depth` as the server answers it on a fresh session of this task (whose
    workspace is a copy of environment/app): the same walk, `protocol.list_dir_entries`."""
    fd = os.open(Path(task_dir) / "environment" / "app", os.O_RDONLY | os.O_DIRECTORY)
    try:
        return protocol.list_dir_result(protocol.APP, protocol.list_dir_entries(fd, protocol.APP, depth))
    finally:
        os.close(fd)


def _summary(changed, added, deleted, before, after) -> str:
    if not (changed or added or deleted):
        return "The repository needed no changes for this request."
    lines = ["Done. Summary of the changes:"]
    for p in changed:
        diff = list(
            difflib.unified_diff(
                before[p].decode("utf-8", "replace").splitlines(),
                after[p].decode("utf-8", "replace").splitlines(),
                lineterm="",
                n=0,
            )
        )
        plus = sum(1 for d in diff if d.startswith("+") and not d.startswith("+++"))
        minus = sum(1 for d in diff if d.startswith("-") and not d.startswith("---"))
        lines.append(f"- `{p}`: modified (+{plus} / -{minus} lines)")
    lines += [f"- `{p}`: created ({len(after[p].splitlines())} lines)" for p in added]
    lines += [f"- `{p}`: deleted" for p in deleted]
    return "\n".join(lines)


def iter_task_dirs(tasks_dir: str | Path) -> Iterator[Path]:
    root = Path(tasks_dir)
    if not root.is_dir():
        raise DataConfigError(f"tasks directory {str(root)!r} does not exist (relative to {Path.cwd()})")
    # natural order (set-constant-2 before set-constant-10): generated seeds stay in seed order
    found = sorted(
        (p.parent for p in root.glob("*/instruction.md")),
        key=lambda d: [int(x) if x.isdigit() else x for x in re.split(r"(\d+)", d.name)],
    )
    if not found:
        raise DataConfigError(f"no tasks under {str(root)!r}: expected subdirectories holding instruction.md")
    yield from found


def make_sft(
    tasks_dir: str | Path, out_file: str | Path, *, timeout_s: float = 60.0, skipped: list[str] | None = None
) -> int:
    """Write one JSON line {"task", "messages"} per task to out_file; returns the count. A task whose
    solution the tool protocol cannot write (UnrepresentableSolution) is left out, its reason
    appended to `skipped`."""
    convs = []
    for t in iter_task_dirs(tasks_dir):
        try:
            convs.append(task_conversation(t, timeout_s=timeout_s))
        except UnrepresentableSolution as e:
            if skipped is not None:
                skipped.append(str(e))
    write_jsonl(convs, out_file)
    return len(convs)


def write_jsonl(convs: list[dict], out_file: str | Path) -> None:
    out = Path(out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w") as f:
        for c in convs:
            f.write(json.dumps(c, ensure_ascii=False) + "\n")
