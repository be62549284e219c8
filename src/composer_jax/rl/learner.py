"""The learner: sample groups of rollouts, train steps on them, update the samplers.

Groups: `rl.group_size` rollouts of one task (`rl.tasks` in turn; a generated family `gen/NAME` gets
a new seed per group), concurrent through the samplers (one backend, rl/samplers/: the in-process
continuous-batching sampler, `composer-jax serve` replicas in other processes - given by URL in
`rl.sampler_urls`, or `rl.local_samplers` of them started by the run, optionally each pinned to its
own core with the trainer on another - or vLLM replicas) and the environment servers; rewards
composed from the grade and the auxiliary terms. The rollout queue (`rl/rollout/queue.py`) keeps groups
sampling while the trainer steps, within `rl.max_staleness` policy versions; each finished group is
persisted (`rl/rollout/group_store.py`) before it is queued. A step takes up to `rl.groups_per_step` whole
groups that fit one batch (`train.batch_size` rows of `train.seq_len`; the rest wait), builds the
batch (`rl/algo/batch.py`: one row per generation), steps the RL objective (`rl/algo/loss.py`) with the
pretraining step's code in a worker thread, then hands the new weights to the samplers between two
decode steps (`update_weights`, policy version = step) and publishes them to `rl.weight_store`;
replicas in other processes are told to load that version from the store
(`RemoteTokenPolicy.load_version`, answered once a decode step ran with it), so a version's groups
start on its weights there too. `rl.max_staleness: 0` is the synchronous learner: each step's groups
are sampled by its weights.
The loop (step count, logs, evaluation and checkpoint cadence, `stop_after`, the summary) is the
trainer shell's (`train/shell.py`); the `Learner` supplies its parts.

Checkpoints hold the group ids done (trained or dropped); a resumed run trains the persisted
groups not done first, samples again those that were in flight (same id: same task and seeds),
and never trains an id twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from composer_jax.checkpoint.manager import TrainCheckpointer
from composer_jax.config import Config, ConfigError, check_rl_run, to_dict
from composer_jax.hf.init_from import resolve_model_from
from composer_jax.rl.algo import batch as rl_batch
from composer_jax.rl.algo.distill import Teacher
from composer_jax.rl.algo.loss import reference_logprobs, rl_objective
from composer_jax.rl.algo.rewards import mean_components
from composer_jax.rl.evaluate import SUCCESS, HeldOutEvaluation, held_out_tasks
from composer_jax.rl.hosts import Hosts
from composer_jax.rl.judges.panel import judge_keys
from composer_jax.rl.restore import Start, restore_or_init
from composer_jax.rl.rollout.group_store import Group, GroupStore
from composer_jax.rl.rollout.ledger import GroupLedger, GroupsState, ResumePoint, resume_groups
from composer_jax.rl.rollout.queue import staleness
from composer_jax.rl.rollout.side import Rollouts, RolloutSide, sample_group
from composer_jax.rl.samplers.engines import engine_of
from composer_jax.rl.samplers.in_process import in_process_samplers
from composer_jax.rl.samplers.vllm_launch import with_vllm_settings
from composer_jax.runtime.profile import Profile
from composer_jax.sharding import MeshRules, ShardingRules, make_mesh
from composer_jax.train.loop import run_checkpoint_config, run_tokenizer
from composer_jax.train.observe import scalars
from composer_jax.train.shell import Cadence, Evaluation, Parts, StepLog, TrainerShell
from composer_jax.train.state import TrainState
from composer_jax.train.step import batch_sharding, make_train_step
from composer_jax.weightsync.publisher import store_publisher

__all__ = ["Learner", "check_config", "run_rl", "step_report"]


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
            # rollouts whose grade named tampering with grading (their reward is 0)
            "rollout/tampered": float(sum(r.tampered for r in rollouts)),
            # where a rollout's time goes: awaiting the sampler, the environment, in all (seconds)
            "rollout/policy_s": float(np.mean([r.policy_s for r in rollouts])),
            "rollout/env_s": float(np.mean([r.env_s for r in rollouts])),
            "rollout/wall_s": float(np.mean([r.wall_s for r in rollouts])),
            "rollout/groups": float(len(groups)),
        }
    )
    return out


def _copy(tree: Any) -> Any:
    """A copy the sampler owns: the train step donates the state's buffers."""
    return jax.tree.map(jnp.copy, tree)


def check_config(cfg: Config) -> None:
    """The learner's checks of `cfg` against this job (`config.check_rl_run`: process count, cores;
    on process 0, which judges, the judges' keys in the environment)."""
    check_rl_run(cfg, process_count=jax.process_count(), cores=os.sched_getaffinity(0))
    if jax.process_index() == 0:
        judge_keys(cfg.rl.reward.judges, os.environ)


def run_rl(
    cfg: Config,
    *,
    mesh=None,
    init_params: Any = None,
    echo: Callable[[str], None] = print,
    stop_after: int | None = None,
) -> dict[str, Any]:
    """Train with RL for train.steps steps. Starts from the run's latest checkpoint when there is
    one (and the groups persisted under the run directory it has not trained), else `init_params`
    (e.g. from a notebook), else train.init_from, else a fresh model.
    stop_after: return once this many steps ran in this call (as a crash would, for resume tests).
    Returns a summary: per-step values (`summary["steps"][n]`), the group ids each step trained
    (`summary["trained_groups"][n]`), the dropped ones and the evaluations."""
    cfg = resolve_model_from(cfg, mesh.devices.size if mesh is not None else "auto")
    check_config(cfg)
    cfg = with_vllm_settings(cfg, echo)
    return asyncio.run(_run(cfg, mesh, init_params, echo, stop_after))


async def _run(
    cfg: Config, mesh, init_params: Any, echo: Callable[[str], None], stop_after: int | None
) -> dict[str, Any]:
    learner = Learner(cfg, mesh=mesh, init_params=init_params, echo=echo)
    async with contextlib.AsyncExitStack() as stack:
        await learner.start_rollout_side(stack)
        await learner.run(stop_after)
    return learner.close()


class Learner:
    """One learner (module docstring): the train state and its step, the group ledger, the weight
    publisher, the held-out evaluation and, on process 0, the rollout side (`Rollouts`).

    Built in two parts so that a step can run without any process or server: the constructor
    restores or initialises the state and builds the step (no child process, no connection);
    `attach(rollouts)` gives it a rollout side (`start_rollout_side` starts the real one); then
    `await step(n)` trains step n, or `await run()` the whole loop."""

    def __init__(self, cfg: Config, *, mesh=None, init_params: Any = None, echo: Callable[[str], None] = print):
        self.mesh = mesh if mesh is not None else make_mesh(cfg.mesh)
        cfg = resolve_model_from(cfg, self.mesh.devices.size)  # model.from (a no-op once resolved)
        t, r = cfg.train, cfg.rl
        self.cfg = cfg
        self.checkpointer = TrainCheckpointer(run_checkpoint_config(cfg))
        self.hosts = Hosts(before_share=self.checkpointer.wait)
        self.echo = echo if self.hosts.lead else (lambda _line: None)
        self.rules = ShardingRules.create(cfg.sharding_rules)
        self.tok = run_tokenizer(cfg)
        self.out_dir = Path(t.out_dir)
        self.run_config = to_dict(cfg)
        self.store = GroupStore(self.out_dir / "rollouts")
        begin = restore_or_init(
            cfg,
            self.mesh,
            self.rules,
            self.checkpointer,
            run_config=self.run_config,
            init_params=init_params,
            echo=self.echo,
        )
        self.begin: Start = begin
        self.state: TrainState = begin.state
        self.ledger = GroupLedger(begin.done)
        self.step_fn = make_train_step(cfg, self.mesh, self.rules, objective=rl_objective(cfg))
        self.batch_sharding = batch_sharding(self.mesh, self.rules, (t.batch_size, t.seq_len))
        self.ref_params = self.ref_fn = None
        if r.loss.kl_coef > 0:  # the frozen reference: the policy the run started from
            sharding = MeshRules(self.mesh, self.rules)
            # (with train.lora the frozen base itself, read from the state at each step: `_reference`)
            self.ref_params = None if self.state.frozen is not None else _copy(self.state.params)
            self.ref_fn = jax.jit(lambda p, b: reference_logprobs(p, b, cfg, sharding))
        # on-policy distillation: the teacher that scores each step's sampled tokens (rl/algo/distill.py)
        self.teacher = Teacher(r.distill, self.tok) if r.loss.objective == "distill" and self.hosts.lead else None
        self.engine = engine_of(cfg)  # what samples the rollouts (rl/samplers/engines.py)
        self.store_url = self.engine.store_url(cfg, self.out_dir)
        self.publish = store_publisher(
            self.store_url, resumed=begin.resumed, start=begin.step, dtype=r.publish_dtype, echo=self.echo
        )
        self.shell = TrainerShell(
            "rl",
            Cadence(t.steps, begin.step, t.log_every, r.eval_every),
            self.checkpointer,
            out_dir=self.out_dir,
            tensorboard=t.tensorboard,
            lead=self.hosts.lead,
            echo=self.echo,
        )
        self.shell.record_init(begin.step, begin.init)
        self.evaluation = HeldOutEvaluation(
            held_out_tasks(r.eval_tasks, r.eval_seeds, r.eval_seed),
            samples=r.eval_samples,
            seed=r.eval_seed,
            outcome_dir=self.out_dir / "eval_outcomes",
        )
        self.rollouts: Rollouts | None = None
        # where the time goes (runtime/profile.py): the cores this process may use now, before
        # rl.pin_cores pins the trainer to one of them (its children's cores are in this set)
        self.profile = Profile(os.sched_getaffinity(0), self._profile_counters)
        self.summary: dict[str, Any] = {"steps": {}}  # the learner's own keys beside the shell's
        self._waited = self._busy = 0.0  # the step loop's time waiting for groups / training

    # -- the rollout side ---------------------------------------------------------------------------
    def resume_point(self) -> ResumePoint:
        """Process 0: where the rollout queue starts (the persisted groups to train first, the ids
        to sample again, one past the highest id used, the version and the group budget)."""
        b, t = self.begin, self.cfg.train
        ready, again, end = resume_groups(self.store, self.ledger.done, b.next_group, b.step, self.echo)
        if b.step:
            self.echo(
                f"[rl] resumed from step {b.step} ({self.checkpointer.step_dir(b.step)}) at group "
                f"{self.ledger.done.below}: {len(ready)} persisted group(s) to train, {len(again)} to sample again"
            )
        budget = (t.steps - b.step) * self.cfg.rl.groups_per_step
        return ResumePoint(tuple(ready), tuple(again), end, b.step, budget)

    async def start_rollout_side(self, stack: contextlib.AsyncExitStack) -> None:
        """Process 0: start the real rollout side (`RolloutSide.start`), closed by `stack`; the
        other processes only train."""
        if self.engine.checkpoint_first(self.cfg) and not self.begin.resumed:
            # the replicas start from a checkpoint of the run (then follow the store): step `start`
            self._save(self.begin.step, force=True)
            self.checkpointer.wait()

        async def start() -> RolloutSide:
            return await RolloutSide.start(
                stack,
                self.cfg,
                make_samplers=in_process_samplers,
                policy_args={
                    "params": _copy(self.state.model_params(self.cfg)),
                    "tok": self.tok,
                    "version": self.begin.step,
                    "mesh": self.mesh,
                    "rules": self.rules,
                },
                checkpoint_dir=self.checkpointer.config.directory,
                out_dir=self.out_dir,
                echo=self.echo,
                store_url=self.store_url,
                resume=self.resume_point(),
                store=self.store,
                sample_group=sample_group,
            )

        self.attach(await self.hosts.run("starting the rollout side", start))

    def attach(self, rollouts: Rollouts | None) -> None:
        """The rollout side this process drives (None on processes other than 0)."""
        self.rollouts = rollouts

    async def _profile_counters(self) -> dict[str, dict[str, float]]:
        return await self.rollouts.profile_counters() if self.rollouts is not None else {}

    # -- one step -----------------------------------------------------------------------------------
    def fits(self, taken: list[Group], g: Group) -> bool:
        """Whether group `g` still fits the batch after `taken`."""
        rows = self.cfg.train.batch_size
        if g.rows > rows:
            raise ConfigError(
                f"group {g.index} ({g.task.name}) has {g.rows} generations but a batch holds train.batch_size="
                f"{rows} rows; raise train.batch_size to at least rl.group_size x (1 + agent.max_summaries)"
            )
        return sum(x.rows for x in taken) + g.rows <= rows

    async def take(self, step: int) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
        """Process 0: step `step`'s header (the ids it trains, the ids finished untrained since the
        last step, its groups' logged values) and its host batch."""
        assert self.rollouts is not None
        r = self.cfg.rl
        groups, stale = await self.rollouts.take(step, self.fits)
        finished = self.rollouts.finished_untrained()
        so_far = self.ledger.untrained_so_far(finished)
        if not groups:
            raise RuntimeError(
                f"step {step}: no group left to train (lost: {so_far['lost_groups']}, dropped as stale: "
                f"{so_far['dropped_stale_groups']}); see the warnings above"
            )
        if stale:
            self.echo(f"[rl] step {step + 1}: dropped {len(stale)} stale group(s) {[g.index for g in stale]}")
        rollouts = [
            rl_batch.ScoredRollout(g.index, b.total, [rl_batch.trained_part(x) for x in ro.generations])
            for g in groups
            for ro, b in zip(g.rollouts, g.rewards)
        ]
        if self.teacher is not None:  # off the event loop: the rollout side keeps sampling meanwhile
            rollouts = await asyncio.to_thread(self.teacher.score, rollouts)
        host = rl_batch.build_batch(rollouts, self.cfg)
        lags = [staleness(g, step, r.staleness_unit) for g in groups]
        values = {**step_report(groups), **rl_batch.version_lag(rollouts, step)}
        values.update(
            {
                "staleness/mean": float(np.mean(lags)),
                "staleness/max": float(max(lags)),
                **{f"staleness/groups_{d}": float(lags.count(d)) for d in range(r.max_staleness + 1)},
                "rl/dropped_stale_groups": float(len(so_far["dropped_stale_groups"])),
                **self.rollouts.queue_values(),
            }
        )
        header = {"error": "", "groups": [g.index for g in groups], "finished": finished, "values": values}
        return header, host

    def train(self, host: dict[str, np.ndarray] | None, version: int) -> tuple[dict[str, float], Any]:
        """One step of the objective on process 0's batch `host` (None on the others: they receive
        their rows here), in a worker thread; publishes the new weights as `version`. Returns the
        step's values and the sampler's copy of the new weights."""
        t0 = time.perf_counter()
        batch, moved = self.hosts.batch(host, self.batch_sharding)  # (its permute has a one-axis mesh of its own)
        with jax.set_mesh(self.mesh):
            if self.ref_fn is not None:
                ref = self.ref_params if self.state.frozen is None else self.state.frozen
                batch["ref_logprobs"] = self.ref_fn(ref, batch)
            self.state, metrics = self.step_fn(self.state, batch)
            values = {**scalars(jax.device_get(metrics)), **moved}  # waits for the step
            t1 = time.perf_counter()
            # a publish is the trained tree: with train.lora the adapters' bytes only; the in-process
            # samplers get the merged model (their own copy: the step donates the state's buffers)
            self.publish(_copy(self.state.params), version)
            params = _copy(self.state.model_params(self.cfg))
            # the step's parts: the batch and the update, then the new version to the weight store
            values.update({"time/update_s": t1 - t0, "time/publish_s": time.perf_counter() - t1})
            return values, params

    async def step(self, step: int) -> dict[str, float]:
        """Train step `step` -> policy version step + 1: take its groups (process 0; shared with the
        others), train, hand the version to the samplers; returns the step's logged values."""
        t0 = time.perf_counter()
        taken = await self.hosts.run(f"step {step}", self.take, step)
        header = await self.hosts.share(taken[0] if taken is not None else None)
        self.ledger.finish_untrained(header["finished"])
        t1 = time.perf_counter()
        values, params = await asyncio.to_thread(self.train, taken[1] if taken is not None else None, step + 1)
        t_load = time.perf_counter()
        if self.rollouts is not None:
            where, trained = f"handing version {step + 1} to the samplers", len(header["groups"])
            await self.hosts.run(where, self.rollouts.hand_over, params, step + 1, trained)
        t2 = time.perf_counter()
        self._waited, self._busy = self._waited + t1 - t0, self._busy + t2 - t1
        self.ledger.finish_trained(step + 1, list(header["groups"]))
        values.update(header["values"])
        values.update(
            {
                "time/wait_s": t1 - t0,
                "time/train_s": t2 - t1,
                "time/load_wait_s": t2 - t_load,  # waiting for replicas to serve the version
                "time/step_s": t2 - t0,
            }
        )
        # the step's interval: from the previous step's (or evaluation's) end to now
        values.update(await self.profile.mark())
        return values

    # -- the trainer shell's parts ------------------------------------------------------------------
    async def evaluate(self, n: int) -> Evaluation:
        """The held-out evaluation of the policy as of step `n` (process 0; None on the others)."""

        async def held_out() -> Evaluation:
            assert self.rollouts is not None
            await self.profile.mark()  # (the moments since the step's end are nobody's)
            out = await self.evaluation.run(n, self.rollouts.sample_tasks)
            spent = await self.profile.mark()
            if out is not None:
                out[0].update({f"eval/{k}": v for k, v in spent.items()})
            return out

        return await self.hosts.run(f"the evaluation at step {n}", held_out)

    def _save(self, n: int, *, force: bool = False) -> bool:
        """Checkpoint step `n` (train state, next group id, done ids) when due or forced."""
        # (several processes: process 0's data state is the one written, by orbax's primary host)
        next_group = self.rollouts.next_index if self.rollouts is not None else self.begin.next_group
        data_state = GroupsState(next_group, self.ledger.done).data_state()
        # (with train.lora the adapters and their optimiser state only: the base is the run config's
        # train.init_from, or the seeded fresh model, and is loaded again on a resume)
        state = self.state.checkpointed()
        return self.checkpointer.save(n, state, data_state=data_state, config=self.run_config, force=force)

    def checkpoint(self, n: int, force: bool) -> None:
        """Checkpoint step `n` (the shell calls it when due): first remove the files of groups the
        last committed checkpoint covers (the ids done so far are then covered by this one)."""
        if self.ledger.has_removable():
            self.checkpointer.wait()  # the earlier save is committed: the files it covers can go
            self.hosts.call("removing trained groups' files", self.store.remove, self.ledger.removable())
        if self._save(n, force=force):
            self.ledger.saved(n)

    async def shell_step(self, step: int) -> StepLog:
        """`step(step)` with its values in the summary, and the progress line."""
        values = await self.step(step)
        self.summary["steps"][step + 1] = values
        line = (
            f"reward {values['reward/total']:.3f} success {values['rollout/success']:.2f} "
            f"mismatch-kl {values.get('mismatch_kl_k1', 0.0):.1e}"
        )
        return StepLog(values, line)

    async def before_steps(self) -> None:
        """After the step-0 evaluation: the setup's end (the others wait for process 0's), the
        start version published, the rollout queue started."""
        await self.hosts.share()
        await self.profile.start()  # (taken by the step-0 evaluation when there was one)
        if self.begin.step < self.cfg.train.steps:
            await asyncio.to_thread(self.publish, self.state.params, self.begin.step)
            if self.rollouts is not None:
                self.hosts.call("starting the rollout queue", self.rollouts.start_queue)

    async def after_steps(self) -> None:
        """Process 0 after the last step, before the final evaluation: the rollout queue stopped,
        the replicas' health."""

        async def finish() -> None:
            assert self.rollouts is not None
            await self.rollouts.stop_queue()
            self.summary["samplers"] = await self.rollouts.health()

        await self.hosts.run("the end of the run", finish)

    async def run(self, stop_after: int | None = None) -> None:
        """The trainer shell's loop over these parts: steps from the start step to train.steps (or
        `stop_after` of them, as a crash would), with the evaluations, checkpoints and the end of
        the run."""
        parts = Parts(self.shell_step, self.evaluate, self.checkpoint, self.before_steps, self.after_steps)
        with jax.set_mesh(self.mesh):
            await self.shell.run(parts, stop_after)
            await self.hosts.share()  # the others stop with an error process 0 had since

    def close(self) -> dict[str, Any]:
        """Wait for the last checkpoint, remove the files it covers, close the logs; the summary."""
        self.checkpointer.wait()
        if self.teacher is not None:
            self.teacher.close()
        removable = self.ledger.removable()
        if self.hosts.lead:
            self.store.remove(removable)
        s, ledger = {**self.shell.close(), **self.summary}, self.ledger
        s["trained_groups"] = ledger.trained
        s.update(ledger.untrained)
        # the share of the trainer's loop spent waiting for groups (not training, publishing, updating)
        total = self._waited + self._busy
        s["trainer_idle_fraction"] = self._waited / total if total > 0 else 0.0
        return s
