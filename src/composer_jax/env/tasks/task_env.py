"""A task's Python environment through the sandbox's `EnvCache` (`env/sandbox/pyenv.py`): the
environment a task declares, built once, and every task's built up front (`env-server`, `env build`).

These read a `Task` and so belong to the task package; the cache itself knows only specs, which
keeps `env/sandbox/` from importing `env/tasks/` (the two packages were a circle).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable, Iterable
from typing import TextIO

from composer_jax.env.sandbox.pyenv import BuiltEnv, EnvBuildError, EnvCache
from composer_jax.env.tasks.store import Task

Progress = Callable[[str, "BuiltEnv | EnvBuildError", float], None]


async def for_task(cache: EnvCache, task: Task) -> BuiltEnv | None:
    """The task's built environment, built now if it is not yet (None when it declares none)."""
    spec = task.config.environment
    return None if spec is None else await cache.ensure(spec, task.app_dir)


async def build_all(
    cache: EnvCache, tasks: Iterable[Task], progress: Progress | None = None
) -> dict[str, BuiltEnv | EnvBuildError]:
    """Build every task's environment (each distinct key once); {task_id: env or its error}."""
    out: dict[str, BuiltEnv | EnvBuildError] = {}
    for task in tasks:
        if task.config.environment is None:
            continue
        t0 = time.monotonic()
        try:
            out[task.task_id] = await cache.ensure(task.config.environment, task.app_dir)
        except EnvBuildError as exc:
            out[task.task_id] = exc
        if progress is not None:
            progress(task.task_id, out[task.task_id], time.monotonic() - t0)
    return out


def build_envs(cache: EnvCache, tasks: Iterable[Task], out: TextIO = sys.stderr) -> int:
    """Build every task's environment, one line per task (key, seconds or the error); returns failures."""

    def progress(task_id: str, result: BuiltEnv | EnvBuildError, seconds: float) -> None:
        if isinstance(result, EnvBuildError):
            print(f"env {task_id}: FAILED {result.reason}\n{result.log_tail[-1500:]}", file=out, flush=True)
        else:
            built = cache.build_seconds.get(result.key)
            how = f"built in {built:.1f}s" if built is not None else "cached"
            print(f"env {task_id}: {result.key[:16]} python {result.python_version} {how}", file=out, flush=True)

    results = asyncio.run(build_all(cache, tasks, progress))
    return sum(1 for r in results.values() if isinstance(r, EnvBuildError))
