"""`composer-jax env validate DIR`: every task's reference solution scores 1, its untouched
workspace scores 0.

For each task: load and check task.toml (errors name the field), skip with the reason a task the
local sandbox cannot run (never half-run it), grade the untouched workspace (must be 0), run
`solution/solve.sh` on a fresh copy with /solution mounted read-only and grade that (must be 1).
Generated families (`--families`) are validated the same way for the requested seeds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from composer_jax.env.api.errors import TaskError
from composer_jax.env.sandbox.pyenv import EnvBuildError, EnvCache
from composer_jax.env.sandbox.runner import Limits, Sandbox
from composer_jax.env.tasks import grader
from composer_jax.env.tasks.store import Task, TaskStore, load_task
from composer_jax.env.tasks.task_env import for_task


@dataclasses.dataclass
class TaskReport:
    task_id: str
    status: str  # pass | fail | skipped | invalid
    detail: str = ""
    untouched_reward: float | None = None
    oracle_reward: float | None = None
    duration_s: float = 0.0


async def validate_task(
    task: Task, sandbox: Sandbox, scratch: Path, limits: Limits, env_cache: EnvCache | None = None
) -> TaskReport:
    start = time.monotonic()
    if not task.runnable:
        return TaskReport(task.task_id, "skipped", f"not locally runnable: {task.not_runnable_reason}")
    if not (task.solution_dir / "solve.sh").is_file():
        return TaskReport(task.task_id, "fail", "missing solution/solve.sh (the oracle)")
    env = None
    if task.config.environment is not None:
        if env_cache is None:
            return TaskReport(task.task_id, "fail", "the task declares a Python environment and no env cache was given")
        try:
            env = await for_task(env_cache, task)  # built once per distinct environment
        except EnvBuildError as exc:
            return TaskReport(task.task_id, "fail", f"{exc.reason}: {exc.log_tail[-600:].strip()}")
    lease = sandbox.lease(f"validate-{task.task_id.replace('/', '_')}-{time.monotonic_ns()}")
    problems = []
    try:
        untouched = await grader.grade(task, lease, task.app_dir, scratch, limits, env)
        if untouched.reward != 0 or untouched.error:
            if untouched.reward != 0:
                problems.append(f"untouched workspace scored {untouched.reward:g}, expected 0")
        solved, solve_result = await grader.oracle_workspace(task, lease, scratch, limits, env)
        try:
            if solve_result.exit_code != 0:
                problems.append(
                    f"solution/solve.sh exited with {solve_result.exit_code}"
                    f"{' (timed out)' if solve_result.timed_out else ''}: "
                    f"{(solve_result.stderr or solve_result.stdout)[-300:].strip()}"
                )
            oracle = await grader.grade(task, lease, solved, scratch, limits, env)
        finally:
            grader.release_job(solved)
        if oracle.reward != 1:
            problems.append(
                f"reference solution scored {oracle.reward:g}, expected 1"
                f"{'; ' + oracle.error if oracle.error else ''}; verifier output: "
                f"{oracle.output_tail[-300:].strip()!r}"
            )
    finally:
        await lease.close()
    return TaskReport(
        task.task_id,
        "fail" if problems else "pass",
        "; ".join(problems),
        untouched.reward,
        oracle.reward,
        round(time.monotonic() - start, 2),
    )


async def validate_all(
    store: TaskStore,
    sandbox: Sandbox,
    *,
    jobs: int = 2,
    families: Sequence[str] = (),
    seeds: Sequence[int] = (0,),
    limits: Limits | None = None,
    progress=None,
    env_cache: EnvCache | None = None,
) -> list[TaskReport]:
    """Validate every task of `store` (and generated `families` x `seeds`), `jobs` at a time."""
    limits = limits or Limits(wall_seconds=600)
    reports = [TaskReport(name, "invalid", err) for name, err in sorted(store.errors.items())]
    targets: list[tuple[str, int | None]] = [(t, None) for t in store.ids()]
    targets += [(f"gen/{f}", s) for f in families for s in seeds]
    sem = asyncio.Semaphore(max(1, jobs))
    scratch = Path(tempfile.mkdtemp(prefix="composer-jax-validate-"))

    async def one(task_id: str, seed: int | None) -> TaskReport:
        async with sem:
            label = task_id if seed is None else f"{task_id}@{seed}"
            try:
                task = await asyncio.to_thread(store.get, task_id, seed)
                report = await validate_task(task, sandbox, scratch, limits, env_cache)
            except TaskError as exc:
                report = TaskReport(label, "invalid", str(exc))
            except Exception as exc:  # noqa: BLE001 - a broken generator must not stop the others
                report = TaskReport(label, "fail", f"{type(exc).__name__}: {exc}")
            report.task_id = label
            if progress:
                progress(report)
            return report

    reports += await asyncio.gather(*(one(t, s) for t, s in targets))
    return reports


def format_report(reports: list[TaskReport]) -> str:
    width = max([len(r.task_id) for r in reports] + [7])
    lines = [f"{'task':<{width}}  status   untouched  oracle  seconds  detail"]
    for r in reports:
        u = "-" if r.untouched_reward is None else f"{r.untouched_reward:g}"
        o = "-" if r.oracle_reward is None else f"{r.oracle_reward:g}"
        lines.append(f"{r.task_id:<{width}}  {r.status:<7}  {u:>9}  {o:>6}  {r.duration_s:>7.1f}  {r.detail}")
    counts = {s: sum(r.status == s for r in reports) for s in ("pass", "fail", "invalid", "skipped")}
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items()) + f" (of {len(reports)})")
    return "\n".join(lines)


async def check_written(
    root: Path, sandbox: Sandbox, scratch: Path, limits: Limits, env_cache: EnvCache | None = None
) -> str:
    """Why the task just written at `root` does not validate ("" when it does): the gate
    `env mine` and `env import-swebench` put every task through before keeping it."""
    try:
        task = await asyncio.to_thread(load_task, root)
    except TaskError as exc:
        return str(exc)
    report = await validate_task(task, sandbox, scratch, limits, env_cache)
    return "" if report.status == "pass" else report.detail or report.status
