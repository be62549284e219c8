"""The tasks rollouts run and drawing rollouts of them: `TaskRef` (a task on the environment
servers), the sampling seed of the j-th rollout (`rollout_seed`), and many rollouts at once over a
policy pool (`run_rollouts`; `sample_tasks`: N of every task). A training group (`side.py`) and an
evaluation (`rl/evaluate.py`) draw their rollouts here, so both sample the same way; it sits in
`rollout/` because the rollout side uses it and `rl/evaluate.py` (which reads the outcomes) sits
above the rollout package.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from collections.abc import Sequence

from composer_jax.config.agent import AgentConfig
from composer_jax.env.api.client import EnvClient
from composer_jax.rl.rollout.agent import Rollout, RolloutFailed, run_rollout
from composer_jax.rl.samplers.policy import Policy, PolicyPool

_UNSAFE_ID = re.compile(r"[^A-Za-z0-9_.-]+")


@dataclasses.dataclass(frozen=True)
class TaskRef:
    """A task on the environment servers: a task id, or "gen/FAMILY" with the seed that generates it."""

    task_id: str
    env_seed: int | None = None
    category: str = ""
    repo: str = ""  # task.toml [metadata] repo ("owner/name") of a mined or imported task
    instance_id: str = ""  # [metadata] instance_id: the dataset's own id of an imported task

    @classmethod
    def from_listing(cls, entry: dict) -> TaskRef:
        """A task as the environment server lists it (GET /tasks: task_id and its [metadata])."""
        meta = entry.get("metadata") or {}
        return cls(
            entry["task_id"],
            None,
            str(meta.get("category", "")),
            str(meta.get("repo", "")),
            str(meta.get("instance_id", "")),
        )

    @property
    def name(self) -> str:
        return self.task_id if self.env_seed is None else f"{self.task_id}#{self.env_seed}"

    @property
    def submission_id(self) -> str:
        """The prediction's instance_id: the dataset's own, else the name made harness-safe
        ([A-Za-z0-9_.-]; a family seed "gen/x#3" -> "gen_x_3")."""
        return self.instance_id or _UNSAFE_ID.sub("_", self.name).strip("._") or "task"


def rollout_seed(seed: int, j: int) -> int:
    """The sampling seed of the j-th rollout drawn under `seed` (an evaluation's (task, sample)
    pairs, a training group's rollouts): a seed per sample index alone would give sample i of every
    task the same random draws, and on similar tasks (a generated family's seeds) their outcomes
    would move together."""
    return seed * 1_000_003 + j


async def run_rollouts(
    policy: Policy | PolicyPool,
    client: EnvClient,
    jobs: Sequence[tuple[TaskRef, int]],
    cfg: AgentConfig,
    *,
    concurrency: int = 0,
) -> list[Rollout | RolloutFailed]:
    """One rollout per (task, sampling seed) job, concurrently (at most `concurrency` at once; 0:
    all), spread over the policies of a `PolicyPool` (a rollout whose sampler became unavailable is
    redone on another). A rollout whose environment failed on every attempt is returned as its
    RolloutFailed; any other error is raised once every rollout has ended."""
    gate = asyncio.Semaphore(concurrency or max(len(jobs), 1))
    pool = policy if isinstance(policy, PolicyPool) else PolicyPool([policy])

    async def one(task: TaskRef, seed: int) -> Rollout | RolloutFailed:
        async with gate:
            try:
                return await pool.run(
                    lambda p: run_rollout(p, client, task.task_id, cfg, seed=seed, env_seed=task.env_seed)
                )
            except RolloutFailed as exc:
                return exc

    results = await asyncio.gather(*(one(t, seed) for t, seed in jobs), return_exceptions=True)
    for res in results:
        if isinstance(res, BaseException) and not isinstance(res, RolloutFailed):
            raise res
    return [r for r in results if isinstance(r, (Rollout, RolloutFailed))]


async def sample_tasks(
    policy: Policy | PolicyPool,
    client: EnvClient,
    tasks: Sequence[TaskRef],
    samples: int,
    cfg: AgentConfig,
    *,
    seed: int = 0,
    concurrency: int = 16,
) -> dict[TaskRef, list[Rollout | RolloutFailed]]:
    """`samples` rollouts of every task (`run_rollouts`, at most `concurrency` at once), the j-th
    (task, sample) pair on sampling seed `rollout_seed(seed, j)`; a rollout whose environment failed
    on every attempt is kept as its RolloutFailed (and counted as such)."""
    jobs = [(t, i) for t in tasks for i in range(samples)]
    seeded = [(t, rollout_seed(seed, j)) for j, (t, _) in enumerate(jobs)]
    results = await run_rollouts(policy, client, seeded, cfg, concurrency=concurrency)
    out: dict[TaskRef, list[Rollout | RolloutFailed]] = {t: [] for t in tasks}
    for (t, _), r in zip(jobs, results):
        out[t].append(r)
    return out
