"""Grading a workspace with the task's verifier, and the oracle run used by `env validate`.

Grading (Harbor's verifier contract, run locally): the session's current workspace is copied to a
fresh directory, which is mounted at /app (read-write); the task's tests/ at /tests (read-only);
a fresh empty directory at /logs/verifier (read-write). `bash /tests/test.sh` runs with cwd /app.
The reward is read from /logs/verifier/reward.txt (a number) or reward.json ({"reward": x, ...});
per-test results come from /logs/verifier/junit.xml when the tests wrote one. The agent's
workspace itself is never touched by grading, so a session can be graded many times.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import stat
import tempfile
import uuid
import xml.etree.ElementTree as ET
from pathlib import Path

from composer_jax.env import volumes
from composer_jax.env.sandbox import ExecResult, Limits, Mount, SandboxLease
from composer_jax.env.tasks import Task

MAX_DIFF_BYTES = 256 * 1024
_DIFF_SKIP = {"__pycache__", ".pytest_cache", ".git"}


@dataclasses.dataclass
class GradeResult:
    reward: float
    tests: list[dict]  # [{"name", "outcome": passed|failed|error|skipped, "message"}]
    diff: str  # unified diff from the task's initial workspace to the graded one
    error: str | None  # why the reward is 0 without the tests deciding it, if so
    exit_code: int | None
    timed_out: bool
    output_tail: str  # the verifier's last stdout/stderr, for debugging tasks
    duration_s: float
    reward_details: dict = dataclasses.field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def read_reward(logs: Path) -> tuple[float | None, dict, str | None]:
    """(reward, extra fields, error) from reward.txt or reward.json in `logs`."""
    txt, js = logs / "reward.txt", logs / "reward.json"
    for f in (txt, js):
        if f.is_symlink() or (f.exists() and not f.is_file()):
            return None, {}, f"{f.name} is not a regular file"
    if txt.is_file():
        raw = txt.read_text(errors="replace")[:1000].strip()
        try:
            reward = float(raw)
        except ValueError:
            return None, {}, f"reward.txt holds {raw[:80]!r}, not a number"
        return (reward, {}, None) if math.isfinite(reward) else (None, {}, f"reward.txt holds {raw!r}")
    if js.is_file():
        try:
            data = json.loads(js.read_text(errors="replace")[:100_000])
            reward = float(data["reward"])
        except (ValueError, KeyError, TypeError) as exc:
            return None, {}, f'reward.json must be an object with a numeric "reward": {exc}'
        if not math.isfinite(reward):
            return None, {}, f"reward.json reward {reward!r} is not finite"
        return reward, {k: v for k, v in data.items() if k != "reward"}, None
    return None, {}, "the verifier wrote neither /logs/verifier/reward.txt nor reward.json"


def parse_junit(path: Path) -> list[dict]:
    """Per-test outcomes from a JUnit XML file (pytest --junitxml); [] when absent or unreadable."""
    if not path.is_file() or path.is_symlink() or path.stat().st_size > 8 * 2**20:
        return []
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError:
        return []
    tests = []
    for case in root.iter("testcase"):
        name = "::".join(x for x in (case.get("classname"), case.get("name")) if x)
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[child.tag]
                message = (child.get("message") or child.text or "")[:2000]
                break
        tests.append({"name": name, "outcome": outcome, "message": message})
    return tests


def _text_files(root: Path) -> dict[str, bytes]:
    files = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = [d for d in dirnames if d not in _DIFF_SKIP]
        for name in filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            rel = os.path.relpath(p, root)
            if stat.S_ISLNK(st.st_mode):
                files[rel] = b"symlink -> " + os.readlink(p).encode() + b"\n"
            elif stat.S_ISREG(st.st_mode):
                files[rel] = open(p, "rb").read(2 * 2**20) if st.st_size <= 2 * 2**20 else b"\x00large"
    return files


def workspace_diff(before: Path | None, after: Path) -> str:
    """Unified diff (a/ = task's initial workspace, b/ = `after`), capped at MAX_DIFF_BYTES."""
    old = _text_files(before) if before is not None and before.is_dir() else {}
    new = _text_files(after)
    out: list[str] = []
    size = 0
    for rel in sorted(set(old) | set(new)):
        a, b = old.get(rel), new.get(rel)
        if a == b:
            continue
        if (a and b"\x00" in a[:8192]) or (b and b"\x00" in b[:8192]):
            chunk = [f"Binary files a/{rel} and b/{rel} differ\n"]
        else:
            chunk = list(
                difflib.unified_diff(
                    (a or b"").decode("utf-8", "replace").splitlines(keepends=True),
                    (b or b"").decode("utf-8", "replace").splitlines(keepends=True),
                    "/dev/null" if a is None else f"a/{rel}",
                    "/dev/null" if b is None else f"b/{rel}",
                )
            )
        for line in chunk:
            line = line if line.endswith("\n") else line + "\n\\ No newline at end of file\n"
            size += len(line)
            if size > MAX_DIFF_BYTES:
                out.append("... diff truncated ...\n")
                return "".join(out)
            out.append(line)
    return "".join(out)


async def run_in_copy(
    task: Task,
    lease: SandboxLease,
    source: Path,
    scratch_root: Path,
    *,
    command: list[str],
    extra_mounts: list[Mount],
    limits: Limits,
    keep: bool = False,
) -> tuple[Path, Path, ExecResult]:
    """Copy `source` to a fresh volume, run `command` there with /logs/verifier; returns dirs+result."""
    job = scratch_root / f"job-{uuid.uuid4().hex[:12]}"
    job.mkdir(parents=True)
    app, logs = job / "app", job / "logs"
    volumes.create_volume(app, task.config.storage_mb, lease.uid, lease.gid)
    volumes.create_volume(logs, 64, lease.uid, lease.gid)
    volumes.copy_tree(source, app, lease.uid, lease.gid)
    mounts = [Mount(app, "/app", True), Mount(logs, "/logs/verifier", True)] + extra_mounts
    result = await lease.run(command, mounts=mounts, cwd="/app", limits=limits)
    return app, logs, result


def release_job(app: Path) -> None:
    job = app.parent
    volumes.remove_volume(job / "app")
    volumes.remove_volume(job / "logs")
    volumes.remove_volume(job)


async def grade(task: Task, lease: SandboxLease, workspace: Path, scratch_root: Path, limits: Limits) -> GradeResult:
    """Run the task's verifier on a fresh copy of `workspace` (see module docstring)."""
    verifier_limits = limits.with_(
        wall_seconds=task.config.verifier_timeout_sec,
        cpu_seconds=max(limits.cpu_seconds, int(task.config.verifier_timeout_sec) + 1),
    )
    app, logs, result = await run_in_copy(
        task,
        lease,
        workspace,
        scratch_root,
        command=["bash", "/tests/test.sh"],
        extra_mounts=[Mount(task.tests_dir, "/tests", False)],
        limits=verifier_limits,
    )
    try:
        reward, details, error = read_reward(logs)
        if result.timed_out:
            error = f"verifier timed out after {task.config.verifier_timeout_sec}s" + (
                f"; {error}" if error and reward is None else ""
            )
        tests = parse_junit(logs / "junit.xml")
        diff = workspace_diff(task.app_dir, workspace)
    finally:
        release_job(app)
    tail = result.stdout[-4000:] + ("\n--- stderr ---\n" + result.stderr[-4000:] if result.stderr else "")
    return GradeResult(
        reward=reward if reward is not None else 0.0,
        tests=tests,
        diff=diff,
        error=error if reward is None or result.timed_out else None,
        exit_code=result.exit_code,
        timed_out=result.timed_out,
        output_tail=tail,
        duration_s=result.duration_s,
        reward_details=details,
    )


async def oracle_workspace(
    task: Task, lease: SandboxLease, scratch_root: Path, limits: Limits
) -> tuple[Path, ExecResult]:
    """Run solution/solve.sh on a fresh copy of the initial workspace; returns (solved dir, result).

    The caller grades the returned directory and then frees it with `release_job`."""
    source = task.app_dir if task.app_dir.is_dir() else Path(tempfile.mkdtemp())
    solve_limits = limits.with_(wall_seconds=task.config.agent_timeout_sec)
    app, logs, result = await run_in_copy(
        task,
        lease,
        source,
        scratch_root,
        command=["bash", "/solution/solve.sh"],
        extra_mounts=[Mount(task.solution_dir, "/solution", False)],
        limits=solve_limits,
    )
    volumes.remove_volume(logs)
    return app, result
