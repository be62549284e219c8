"""The synchronous learner: sample groups of rollouts, train one step on them, update the sampler.

One step: `rl.groups_per_step` tasks (cycling through `rl.tasks`; a generated family `gen/NAME`
gets a new seed per group), `rl.group_size` rollouts of each, all in flight at once through one
continuous-batching sampler and the environment servers; rewards composed from the grade and the
auxiliary terms; the batch built (`rl/batch.py`: one row per generation) and the RL objective
(`rl/loss.py`) stepped by the pretraining step's code; then the new weights go into the sampler
between two decode steps (`update_weights`, with the step number as the policy version). The
asynchronous learner reuses all of this but the scheduling.

Groups whose generations do not all fit into one batch (`train.batch_size` rows of
`train.seq_len`) wait for the next step, whole, so no rollout is lost and no group is split. The
data position (groups consumed, groups waiting) is saved with every checkpoint: a resumed run
samples the same tasks and seeds it would have.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from composer_jax.checkpoint.manager import TrainCheckpointer, restore_params_only
from composer_jax.config import Config, ConfigError, to_dict
from composer_jax.env.client import EnvClient
from composer_jax.inference.async_sampler import AsyncSampler
from composer_jax.inference.sampler import Sampler
from composer_jax.model.params import abstract_params
from composer_jax.rl import batch as rl_batch
from composer_jax.rl.agent import Rollout, RolloutFailed, run_rollout
from composer_jax.rl.envs import LocalEnvServers
from composer_jax.rl.evaluate import SUCCESS, TaskRef, report, sample_tasks
from composer_jax.rl.loss import reference_logprobs, rl_objective
from composer_jax.rl.policy import TokenPolicy
from composer_jax.rl.rewards import RewardBreakdown, RolloutStats, compose_reward, mean_components
from composer_jax.sharding import MeshRules, ShardingRules, make_mesh
from composer_jax.train.loop import STAGE_CHANGEABLE, run_checkpoint_config, run_tokenizer
from composer_jax.train.observe import Progress, RunLogger, scalars
from composer_jax.train.state import abstract_train_state, init_train_state
from composer_jax.train.step import batch_sharding, make_train_step

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Group:
    """Rollouts of one task sampled together (their rewards' mean is the advantage baseline)."""

    index: int  # position in the run's task stream (the group id)
    task: TaskRef
    rollouts: list[Rollout]
    rewards: list[RewardBreakdown]
    failed: int = 0  # rollouts whose environment failed on every attempt (not scored)

    @property
    def rows(self) -> int:
        return sum(len(r.generations) for r in self.rollouts)


def task_of(cfg: Config, index: int) -> TaskRef:
    """The task of group `index`: rl.tasks in turn; `gen/FAMILY` seeded with rl.task_seed + index."""
    name = cfg.rl.tasks[index % len(cfg.rl.tasks)]
    return TaskRef(name, cfg.rl.task_seed + index if name.startswith("gen/") else None)


def rollout_stats(r: Rollout) -> RolloutStats:
    return RolloutStats(
        grade=r.env_reward,
        tokens=r.generated_tokens,
        turns=r.turns,
        tool_calls=r.tool_calls,
        broken_tool_calls=r.broken_tool_calls,
        parallel_tool_turns=min(r.parallel_tool_turns, r.turns),
    )


async def sample_group(policy: TokenPolicy, client: EnvClient, cfg: Config, index: int) -> Group:
    """`rl.group_size` rollouts of group `index`'s task, concurrently."""
    task, g = task_of(cfg, index), cfg.rl.group_size
    seeds = [cfg.train.seed * 1_000_003 + index * g + i for i in range(g)]
    results = await asyncio.gather(
        *(run_rollout(policy, client, task.task_id, cfg.agent, seed=s, env_seed=task.env_seed) for s in seeds),
        return_exceptions=True,
    )
    done: list[Rollout] = []
    failed = 0
    for res in results:
        if isinstance(res, RolloutFailed):
            log.warning("group %d (%s): %s", index, task.name, res)
            failed += 1
        elif isinstance(res, BaseException):
            raise res
        else:
            done.append(res)
    return Group(index, task, done, [compose_reward(rollout_stats(r), cfg.rl.reward) for r in done], failed)


def step_report(groups: list[Group]) -> dict[str, float]:
    """The logged values of one step's groups: reward components, success (mean and best-of-K
    over each group), lengths, tool use."""
    rollouts = [r for g in groups for r in g.rollouts]
    out = mean_components([b for g in groups for b in g.rewards])
    success = [[float(r.env_reward >= SUCCESS) for r in g.rollouts] for g in groups]
    out.update(
        {
            "rollout/success": float(np.mean([s for g in success for s in g])),
            "rollout/best_of_k": float(np.mean([max(g) for g in success])),
            "rollout/generated_tokens": float(np.mean([r.generated_tokens for r in rollouts])),
            "rollout/turns": float(np.mean([r.turns for r in rollouts])),
            "rollout/tool_calls": float(np.mean([r.tool_calls for r in rollouts])),
            "rollout/broken_tool_calls": float(np.mean([r.broken_tool_calls for r in rollouts])),
            "rollout/summaries": float(np.mean([r.summaries for r in rollouts])),
            "rollout/env_retries": float(sum(r.env_retries for r in rollouts)),
            "rollout/env_failures": float(sum(g.failed for g in groups)),
            "rollout/groups": float(len(groups)),
        }
    )
    return out


def _copy(tree: Any) -> Any:
    """A copy the sampler owns: the train step donates the state's buffers."""
    return jax.tree.map(jnp.copy, tree)


class _Batcher:
    """Takes whole groups, in order, while their generations fit into one batch."""

    def __init__(self, rows: int):
        self.rows = rows
        self.waiting: list[Group] = []

    def take(self) -> list[Group]:
        out, used = [], 0
        while self.waiting and used + self.waiting[0].rows <= self.rows:
            used += self.waiting[0].rows
            out.append(self.waiting.pop(0))
        if not out and self.waiting:
            g = self.waiting[0]
            raise ConfigError(
                f"group {g.index} ({g.task.name}) has {g.rows} generations but a batch holds train.batch_size="
                f"{self.rows} rows; raise train.batch_size to at least rl.group_size x (1 + agent.max_summaries)"
            )
        return out


def check_config(cfg: Config) -> None:
    r, t, a = cfg.rl, cfg.train, cfg.agent
    if not r.tasks:
        raise ConfigError("rl.tasks is empty; give the task ids (or gen/FAMILY) to train on")
    if r.group_size < 2:
        raise ConfigError(f"rl.group_size={r.group_size}: a group needs at least 2 rollouts for an advantage")
    if t.batch_size < r.group_size:
        raise ConfigError(
            f"train.batch_size={t.batch_size} rows cannot hold one group of rl.group_size={r.group_size} rollouts"
        )
    if a.max_turn_tokens >= t.seq_len:
        raise ConfigError(
            f"agent.max_turn_tokens={a.max_turn_tokens} must be below train.seq_len={t.seq_len}, the longest "
            "generation a batch row (and the sampler) holds"
        )
    if t.micro_batches > 1 and t.batch_size % t.micro_batches:
        raise ConfigError(f"train.batch_size={t.batch_size} must be divisible by train.micro_batches={t.micro_batches}")


def run_rl(
    cfg: Config,
    *,
    mesh=None,
    init_params: Any = None,
    echo: Callable[[str], None] = print,
    stop_after: int | None = None,
) -> dict[str, Any]:
    """Train with RL for train.steps steps. Starts from the run's latest checkpoint when there is
    one, else `init_params` (e.g. from a notebook), else train.init_from, else a fresh model.
    stop_after: return once this many steps ran in this call (as a crash would, for resume tests).
    Returns a summary: per-step values (`summary["steps"][n]`) and evaluations."""
    check_config(cfg)
    return asyncio.run(_run(cfg, mesh, init_params, echo, stop_after))


async def _run(
    cfg: Config, mesh, init_params: Any, echo: Callable[[str], None], stop_after: int | None
) -> dict[str, Any]:
    t, r = cfg.train, cfg.rl
    mesh = mesh if mesh is not None else make_mesh(cfg.mesh)
    rules = ShardingRules.create(cfg.sharding_rules)
    tok = run_tokenizer(cfg)
    out_dir = Path(t.out_dir)
    ckpt_cfg = run_checkpoint_config(cfg)
    run_config = to_dict(cfg)
    checkpointer = TrainCheckpointer(ckpt_cfg)
    next_group, start = 0, 0
    batcher = _Batcher(t.batch_size)
    if checkpointer.latest_step() is not None:
        restored = checkpointer.restore(abstract_train_state(cfg, mesh, rules), config=run_config)
        state, start = restored.train_state, restored.step
        # groups sampled but not trained before the checkpoint are sampled again (same seeds)
        next_group = int((restored.data_state or {}).get("next_group", 0))
        echo(f"[rl] resumed from step {start} ({checkpointer.step_dir(start)}) at group {next_group}")
    elif init_params is not None:
        state = init_train_state(cfg, mesh, rules, init_params)
    elif t.init_from:
        params = restore_params_only(
            t.init_from,
            abstract_params(cfg.model, mesh, rules),
            config=run_config,
            allow_config_changes=STAGE_CHANGEABLE,
        )
        state = init_train_state(cfg, mesh, rules, params)
        echo(f"[rl] initialised from {t.init_from}")
    else:
        state = init_train_state(cfg, mesh, rules)
    objective = rl_objective(cfg)
    step_fn = make_train_step(cfg, mesh, rules, objective=objective)
    sharding = MeshRules(mesh, rules)
    b_sh = batch_sharding(mesh, rules, (t.batch_size, t.seq_len))
    ref_params = ref_fn = None
    if r.loss.kl_coef > 0:  # the frozen reference: the policy the run started from
        ref_params = _copy(state.params)
        ref_fn = jax.jit(lambda p, b: reference_logprobs(p, b, cfg, sharding))

    sampler = AsyncSampler(
        Sampler(
            _copy(state.params),
            cfg.model,
            slots=r.sampler_slots,
            max_len=t.seq_len,
            version=start,
            mesh=mesh,
            rules=rules,
        )
    )
    policy = TokenPolicy(sampler, tok)
    logger = RunLogger(out_dir, "rl", t.tensorboard)
    progress = Progress(t.steps, start)
    summary: dict[str, Any] = {"steps": {}, "evals": [], "start_step": start}
    eval_tasks = [
        TaskRef(name, r.eval_seed + i if name.startswith("gen/") else None)
        for name in r.eval_tasks
        for i in range(r.eval_seeds if name.startswith("gen/") else 1)
    ]

    async with contextlib.AsyncExitStack() as stack:
        if r.env_urls:
            urls, token = list(r.env_urls), r.env_token or os.environ.get("COMPOSER_JAX_ENV_TOKEN", "")
        else:
            urls, token = stack.enter_context(LocalEnvServers(r.tasks_dir, r.env_servers))
            echo(f"[rl] started {len(urls)} local environment server(s) on {r.tasks_dir}")
        client = await stack.enter_async_context(EnvClient(urls, token))
        stack.push_async_callback(sampler.aclose)

        async def run_eval(step: int) -> None:
            if not eval_tasks:
                return
            res = await sample_tasks(
                policy, client, eval_tasks, r.eval_samples, cfg.agent, seed=10_000_019 + r.eval_seed
            )
            overall = report(res)["overall"]
            ev = {f"eval/{k}": v for k, v in overall.items()}
            summary["evals"].append({"step": step, **ev})
            logger.log(step, ev)
            echo(f"[rl] step {step} held-out pass@1 {overall['pass@1']:.3f} reward {overall['reward']:.3f}")

        with jax.set_mesh(mesh):
            if start == 0:
                await run_eval(0)
            ran = 0
            for step in range(start, t.steps):
                t0 = time.perf_counter()
                while len(batcher.waiting) < r.groups_per_step:
                    want = r.groups_per_step - len(batcher.waiting)
                    new = await asyncio.gather(
                        *(sample_group(policy, client, cfg, next_group + j) for j in range(want))
                    )
                    next_group += want
                    # a group left with fewer than 2 scored rollouts has no advantage: dropped, logged
                    batcher.waiting += [g for g in new if len(g.rollouts) >= 2]
                t_sample = time.perf_counter() - t0
                groups = batcher.take()
                # the data position: the first group not trained yet (waiting ones are resampled on resume)
                position = batcher.waiting[0].index if batcher.waiting else next_group
                rollouts = [
                    rl_batch.ScoredRollout(g.index, b.total, [rl_batch.trained_part(x) for x in ro.generations])
                    for g in groups
                    for ro, b in zip(g.rollouts, g.rewards)
                ]
                host = rl_batch.build_batch(rollouts, cfg)
                batch = {k: jax.device_put(v, b_sh) for k, v in host.items()}
                if ref_fn is not None:
                    batch["ref_logprobs"] = ref_fn(ref_params, batch)
                state, metrics = step_fn(state, batch)
                n = step + 1
                sampler.update_weights(_copy(state.params), n)
                values = scalars(jax.device_get(metrics))
                values.update(step_report(groups))
                values.update(rl_batch.version_lag(rollouts, step))
                values.update({"time/sample_s": t_sample, "time/step_s": time.perf_counter() - t0})
                summary["steps"][n] = values
                if n % t.log_every == 0 or n == t.steps:
                    logger.log(n, values)
                progress.update(
                    n,
                    f"reward {values['reward/total']:.3f} success {values['rollout/success']:.2f} "
                    f"mismatch-kl {values.get('mismatch_kl_k1', 0.0):.1e}",
                )
                if r.eval_every and n % r.eval_every == 0 and n != t.steps:
                    await run_eval(n)
                checkpointer.save(n, state, data_state={"next_group": position}, config=run_config, force=n == t.steps)
                ran += 1
                if stop_after is not None and ran >= stop_after:
                    summary["stopped_at"] = n
                    break
            else:
                if t.steps > start:
                    await run_eval(t.steps)
    progress.close()
    checkpointer.wait()
    checkpointer.close()
    logger.close()
    summary["final_step"] = t.steps
    summary["checkpoint_dir"] = ckpt_cfg.directory
    return summary
