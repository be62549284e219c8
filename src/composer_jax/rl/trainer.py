"""The learner: sample groups of rollouts, train steps on them, update the samplers.

Groups: `rl.group_size` rollouts of one task (`rl.tasks` in turn; a generated family `gen/NAME`
gets a new seed per group), concurrent through the samplers (`make_policies`: the in-process
continuous-batching sampler, or `composer-jax serve` replicas in other processes - given by URL in
`rl.sampler_urls`, or `rl.local_samplers` of them started by the run, optionally each pinned to its
own core with the trainer on another) and the environment servers; rewards composed from the grade and the
auxiliary terms. The rollout queue (`rl/queue.py`) keeps groups sampling while the trainer steps,
within `rl.max_staleness` policy versions; each finished group is persisted
(`rl/rollout_store.py`) before it is queued. A step takes up to `rl.groups_per_step` whole groups
that fit one batch (`train.batch_size` rows of `train.seq_len`; the rest wait), builds the batch
(`rl/batch.py`: one row per generation), steps the RL objective (`rl/loss.py`) with the pretraining
step's code in a worker thread, then hands the new weights to the samplers between two decode
steps (`update_weights`, policy version = step) and publishes them to `rl.weight_store`; replicas in
other processes are told to load that version from the store (`RemoteTokenPolicy.load_version`,
answered once a decode step ran with it), so a version's groups start on its weights there too.
`rl.max_staleness: 0` is the synchronous learner: each step's groups are sampled by its weights.

Checkpoints hold the group ids done (trained or dropped); a resumed run trains the persisted
groups not done first, samples again those that were in flight (same id: same task and seeds),
and never trains an id twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
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
from composer_jax.checkpoint.multihost import ProcessZeroWork, scatter_arrays
from composer_jax.checkpoint.sharded_publish import ShardedWeightPublisher
from composer_jax.checkpoint.weight_sync import WeightPublisher, WeightSubscriber, open_store, rewind_store
from composer_jax.config import Config, ConfigError, to_dict
from composer_jax.env.client import EnvClient
from composer_jax.inference.async_sampler import AsyncSampler
from composer_jax.inference.sampler import Sampler
from composer_jax.model.params import abstract_params
from composer_jax.rl import batch as rl_batch
from composer_jax.rl.agent import Rollout, RolloutFailed, run_rollout
from composer_jax.rl.envs import LocalEnvServers
from composer_jax.rl.evaluate import SUCCESS, TaskRef, format_paired, outcomes, paired_difference, report, sample_tasks
from composer_jax.rl.launch import START_TIMEOUT_S, LocalSamplers
from composer_jax.rl.loss import reference_logprobs, rl_objective
from composer_jax.rl.policy import Policy, PolicyPool, SamplerUnavailable, TokenPolicy
from composer_jax.rl.queue import DoneIds, RolloutQueue, staleness
from composer_jax.rl.remote_policy import RemoteTokenPolicy
from composer_jax.rl.rewards import RolloutStats, compose_reward, mean_components
from composer_jax.rl.rollout_store import Group, GroupStore, RolloutStoreError
from composer_jax.sharding import MeshRules, ShardingRules, make_mesh
from composer_jax.train.loop import STAGE_CHANGEABLE, run_checkpoint_config, run_tokenizer
from composer_jax.train.observe import Progress, RunLogger, scalars
from composer_jax.train.state import abstract_train_state, init_train_state
from composer_jax.train.step import batch_sharding, make_train_step

log = logging.getLogger(__name__)


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


async def sample_group(policies: PolicyPool | Policy, client: EnvClient, cfg: Config, index: int) -> Group:
    """`rl.group_size` rollouts of group `index`'s task, concurrently, spread over `policies` (a
    rollout whose sampler becomes unavailable is redone on another)."""
    task, g = task_of(cfg, index), cfg.rl.group_size
    pool = policies if isinstance(policies, PolicyPool) else PolicyPool([policies])
    seeds = [cfg.train.seed * 1_000_003 + index * g + i for i in range(g)]

    async def one(seed: int) -> Rollout:
        return await pool.run(
            lambda p: run_rollout(p, client, task.task_id, cfg.agent, seed=seed, env_seed=task.env_seed)
        )

    results = await asyncio.gather(*(one(s) for s in seeds), return_exceptions=True)
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
    if jax.process_count() > 1:
        if not (r.sampler_urls or r.local_samplers):
            raise ConfigError(
                f"a trainer of {jax.process_count()} processes samples through `composer-jax serve` replicas: give "
                "rl.sampler_urls (replica URLs) or rl.local_samplers >= 1 (started by process 0); the in-process "
                "sampler (rl.local_samplers=0, no rl.sampler_urls) runs inside a one-process trainer only"
            )
        if r.pin_cores:
            raise ConfigError(
                f"rl.pin_cores=true pins a one-process trainer and its replicas on one machine; this trainer has "
                f"{jax.process_count()} processes: accepted rl.pin_cores=false"
            )
    if r.pin_cores:
        if not r.local_samplers:
            raise ConfigError(
                "rl.pin_cores pins the trainer and the rl.local_samplers replicas to cores of their own; "
                "with rl.local_samplers=0 there is nothing to pin apart"
            )
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < 1 + r.local_samplers:
            raise ConfigError(
                f"rl.pin_cores with rl.local_samplers={r.local_samplers} needs {1 + r.local_samplers} cores "
                f"(one for the trainer, one per replica); this process may use {len(cores)}: {cores}"
            )
    if r.queue_size and r.queue_size < r.groups_per_step:
        raise ConfigError(
            f"rl.queue_size={r.queue_size} cannot hold one step's rl.groups_per_step={r.groups_per_step} groups; "
            "give at least that, or 0 (bounded by the staleness only)"
        )


def make_policies(
    cfg: Config, params: Any, tok, *, version: int, mesh, rules, remote: tuple[list[str], str] | None = None
) -> list[Policy]:
    """The samplers rollouts are spread over: with `remote` (replica URLs, bearer key) one
    `RemoteTokenPolicy` per replica (they follow `rl.weight_store`); else the in-process
    continuous-batching sampler (a `TokenPolicy` on an `AsyncSampler`) holding `params` as policy
    `version`."""
    r, t = cfg.rl, cfg.train
    if remote is not None:
        urls, key = remote
        return [RemoteTokenPolicy(u, key, tok, max_context=t.seq_len) for u in urls]
    inner = Sampler(
        params,
        cfg.model,
        slots=r.sampler_slots,
        max_len=t.seq_len,
        version=version,
        mesh=mesh,
        rules=rules,
        prefix_cache=r.sampler_prefix_cache,
    )
    if r.sampler_warm_up and mesh is None:  # a mesh sampler admits one prompt at a time: compiled at first use
        inner.warm_up()
    return [TokenPolicy(AsyncSampler(inner), tok)]


def pin_threads(cores: set[int], pid: int | str = "self") -> int:
    """Pin every thread of process `pid` (JAX's pools included: `sched_setaffinity` on a pid moves
    one thread only) to `cores`; returns the number of threads pinned. Children started later
    inherit the mask."""
    n = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cores)
            n += 1
    return n


def _published(params: Any, dtype: str) -> Any:
    """The host copy published to the weight store: floating leaves cast to `dtype` ("" = as is).
    With several processes every array is gathered to every process (a collective); the trainer
    then publishes per shard instead (`_store_publisher`)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        host = multihost_utils.process_allgather(params, tiled=True)
    else:
        host = jax.device_get(params)
    if not dtype:
        return host
    return jax.tree.map(lambda x: x.astype(dtype) if np.issubdtype(x.dtype, np.floating) else x, host)


def _store_publisher(
    store_url: str, *, resumed: bool, start: int, dtype: str, echo: Callable[[str], None]
) -> Callable[[Any, int], None]:
    """`publish(params, version)`, which every process of the trainer calls for every version (a
    collective): one process gathers (`_published`) and writes with a `WeightPublisher`; several
    each write their own shards (`ShardedWeightPublisher`: no host gathers the model). On a resume
    the store is rewound to the checkpoint's version `start` first."""
    if not store_url:
        return lambda params, version: None
    # the store's versions before this run: every process reads them (a publish is a collective,
    # which all must skip or all take)
    stored = set(WeightSubscriber(store_url).versions())
    if stored and (not resumed or (start not in stored and max(stored) > start)):
        raise ConfigError(
            f"rl.weight_store={store_url!r} holds versions {sorted(stored)[:5]}..{max(stored)} that are not this "
            f"run's ({'a fresh run' if not resumed else f'resumed at step {start}, a version it lacks'}); "
            "give an empty store (or remove it)"
        )
    # a trainer stopped after its last checkpoint: the versions it published since are a lost
    # lineage (its weights died with it); this run publishes those numbers anew. Process 0 rewinds,
    # the others wait for it (and stop with its error if the rewind fails).
    work = ProcessZeroWork()

    def rewind() -> None:
        gone = rewind_store(open_store(store_url), start)
        echo(f"[rl] weight store rewound to version {start}: versions {gone} were of the lost run")

    if stored and max(stored) > start:
        work.call("rewinding the weight store", rewind)
    work.share()
    multi = jax.process_count() > 1
    publisher = WeightPublisher(store_url) if jax.process_index() == 0 and not multi else None
    per_shard = ShardedWeightPublisher(store_url) if multi else None

    def publish(params: Any, version: int) -> None:
        if version == start and start in stored:  # the checkpoint's own weights, published before it
            return
        if per_shard is not None:
            per_shard.publish(params, version, dtype=dtype)
            return
        host = _published(params, dtype)
        if publisher is not None:
            publisher.publish(host, version)

    return publish


def _in_process(policies: list[Policy]) -> list[AsyncSampler]:
    """The in-process samplers behind `policies` (they take new weights by `update_weights`)."""
    out: list[AsyncSampler] = []
    for p in policies:
        s = getattr(p, "sampler", None)
        if isinstance(s, AsyncSampler) and s not in out:
            out.append(s)
    return out


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
    check_config(cfg)
    return asyncio.run(_run(cfg, mesh, init_params, echo, stop_after))


def resume_groups(
    store: GroupStore, done: DoneIds, next_group: int, version: int, echo: Callable[[str], None]
) -> tuple[list[Group], list[int], int]:
    """The persisted groups not done yet (loaded), the ids that were in flight (re-sampled), and
    one past the highest id used. Files of done groups are removed, and so are those of groups with
    tokens of a policy version after `version` (the checkpoint resumed from): a trainer stopped after
    its last checkpoint published versions that died with it, and those groups are sampled again."""
    ready: list[Group] = []
    on_disk = store.indices()
    store.remove([i for i in on_disk if i in done])
    for i in on_disk:
        if i in done:
            continue
        try:
            g = store.load(i)
        except RolloutStoreError as exc:
            echo(f"[rl] {exc}; group {i} is sampled again")
            continue
        if g.newest_token_version() > version:
            newest = g.newest_token_version()
            echo(f"[rl] group {i}: a token of version {newest}, lost with the stopped run; sampled again")
            store.remove([i])
            continue
        ready.append(g)
    end = max([next_group, *(i + 1 for i in on_disk)])
    have = {g.index for g in ready}
    again = [i for i in range(done.below, end) if i not in done and i not in have]
    return ready, again, end


async def _run(
    cfg: Config, mesh, init_params: Any, echo: Callable[[str], None], stop_after: int | None
) -> dict[str, Any]:
    t, r = cfg.train, cfg.rl
    # several processes (a multi-host trainer): process 0 runs the rollout side (environment
    # client, samplers, queue, group store, evaluation), prints and writes the run files; each step
    # it hands the others the chosen groups' ids (`ProcessZeroWork.share`) and their rows of the batch
    # (`scatter_arrays`).
    # Every collective (header share, batch scatter, train step, publish, checkpoint) is entered by all
    # in order.
    lead, multi = jax.process_index() == 0, jax.process_count() > 1
    if not lead:
        echo = lambda _line: None  # noqa: E731
    mesh = mesh if mesh is not None else make_mesh(cfg.mesh)
    rules = ShardingRules.create(cfg.sharding_rules)
    tok = run_tokenizer(cfg)
    out_dir = Path(t.out_dir)
    ckpt_cfg = run_checkpoint_config(cfg)
    run_config = to_dict(cfg)
    checkpointer = TrainCheckpointer(ckpt_cfg)
    store = GroupStore(out_dir / "rollouts")
    outcome_dir = out_dir / "eval_outcomes"  # step_NNNNNN.json: each evaluation's per-rollout success
    next_group, start, done = 0, 0, DoneIds()
    resumed = checkpointer.latest_step() is not None
    if resumed:
        restored = checkpointer.restore(abstract_train_state(cfg, mesh, rules), config=run_config)
        state, start = restored.train_state, restored.step
        data_state = restored.data_state or {}
        next_group = int(data_state.get("next_group", 0))
        # runs saved before the queue: every group below next_group was trained
        done = DoneIds.from_state(data_state["done"]) if "done" in data_state else DoneIds(next_group)
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
    # process 0's own work (rollout side, evaluations, group files): an error in it stops every
    # process at the next point where the others wait on process 0 (`work.share`: the setup's end,
    # each step's header, the end of the run), with process 0's message
    work = ProcessZeroWork(before_share=checkpointer.wait)
    objective = rl_objective(cfg)
    step_fn = make_train_step(cfg, mesh, rules, objective=objective)
    sharding = MeshRules(mesh, rules)
    b_sh = batch_sharding(mesh, rules, (t.batch_size, t.seq_len))
    ref_params = ref_fn = None
    if r.loss.kl_coef > 0:  # the frozen reference: the policy the run started from
        ref_params = _copy(state.params)
        ref_fn = jax.jit(lambda p, b: reference_logprobs(p, b, cfg, sharding))
    store_url = r.weight_store or (f"file://{out_dir.resolve()}/weight_store" if r.local_samplers else "")
    publish = _store_publisher(store_url, resumed=resumed, start=start, dtype=r.publish_dtype, echo=echo)

    if r.local_samplers and not resumed:
        # the replicas start from a checkpoint of the run (then follow the store): step `start`
        data_state = {"next_group": next_group, "done": done.state()}
        checkpointer.save(start, state, data_state=data_state, config=run_config, force=True)
        checkpointer.wait()
    policies: list[Policy] = []
    samplers: list[AsyncSampler] = []
    remotes: list[RemoteTokenPolicy] = []
    logger = RunLogger(out_dir, "rl", t.tensorboard, enabled=lead)
    progress = Progress(t.steps, start) if lead else None
    summary: dict[str, Any] = {
        "steps": {},
        "evals": [],
        "start_step": start,
        "trained_groups": {},
        "dropped_stale_groups": [],
        "lost_groups": [],
    }
    eval_tasks = [
        TaskRef(name, r.eval_seed + i if name.startswith("gen/") else None)
        for name in r.eval_tasks
        for i in range(r.eval_seeds if name.startswith("gen/") else 1)
    ]

    def global_batch(host: dict[str, np.ndarray] | None) -> tuple[dict[str, jax.Array], dict[str, float]]:
        """Process 0's host batch as arrays on the mesh (several processes: each receives only the
        rows its devices hold, `scatter_arrays`), and the bytes moved: the whole batch, and the
        most any other process received."""
        if not multi:
            assert host is not None
            batch = {k: jax.device_put(v, b_sh) for k, v in host.items()}
            return batch, {"batch/bytes": float(sum(v.nbytes for v in host.values()))}
        batch, received = scatter_arrays(host, b_sh)
        return batch, {
            "batch/bytes": float(sum(v.nbytes for v in batch.values())),
            "batch/received_bytes_max": float(max(received)),
        }

    def train_step(state: Any, host: dict[str, np.ndarray] | None, step: int) -> tuple[Any, dict[str, float], Any]:
        """One step of the objective on process 0's batch `host` (None on the others: they receive
        their rows here), in a worker thread: the event loop keeps sampling."""
        t0 = time.perf_counter()
        batch, moved = global_batch(host)  # (its permute runs on a one-axis mesh of its own)
        with jax.set_mesh(mesh):
            if ref_fn is not None:
                batch["ref_logprobs"] = ref_fn(ref_params, batch)
            state, metrics = step_fn(state, batch)
            values = {**scalars(jax.device_get(metrics)), **moved}  # waits for the step
            t1 = time.perf_counter()
            params = _copy(state.params)
            publish(params, step + 1)
            # the step's parts: the batch and the update, then the new version to the weight store
            values.update({"time/update_s": t1 - t0, "time/publish_s": time.perf_counter() - t1})
            return state, values, params

    def fits(taken: list[Group], g: Group) -> bool:
        if g.rows > t.batch_size:
            raise ConfigError(
                f"group {g.index} ({g.task.name}) has {g.rows} generations but a batch holds train.batch_size="
                f"{t.batch_size} rows; raise train.batch_size to at least rl.group_size x (1 + agent.max_summaries)"
            )
        return sum(x.rows for x in taken) + g.rows <= t.batch_size

    async def sample(index: int, version: int) -> Group:
        group = await sample_group(pool, client, cfg, index)
        group.version = version
        return group

    async def persist(group: Group) -> None:
        await asyncio.to_thread(store.save, group)

    def resume() -> tuple[list[Group], list[int], int]:
        out = resume_groups(store, done, next_group, start, echo)
        if start:
            echo(
                f"[rl] resumed from step {start} ({checkpointer.step_dir(start)}) at group {done.below}: "
                f"{len(out[0])} persisted group(s) to train, {len(out[1])} to sample again"
            )
        return out

    ready, again, end = work.call("loading the persisted groups", resume) or ([], [], next_group)
    queue = RolloutQueue(
        sample=sample,
        persist=persist,
        order=itertools.chain(again, itertools.count(end)),
        ready=ready,
        version=start,
        groups_per_step=r.groups_per_step,
        max_staleness=r.max_staleness,
        unit=r.staleness_unit,
        max_in_flight=r.max_groups_in_flight,
        queue_size=r.queue_size,
        budget=(t.steps - start) * r.groups_per_step,
    )
    queue.next_index = max(queue.next_index, end)
    covered: list[tuple[int, list[int]]] = []  # (checkpoint step, group files it makes removable)
    pending_files: list[int] = []  # done groups whose files wait for a checkpoint

    def mark_done() -> dict[str, list[int]]:
        """Ids the queue dropped or lost since the last call (process 0), by summary key."""
        out: dict[str, list[int]] = {}
        for lst, key in ((queue.dropped_stale, "dropped_stale_groups"), (queue.lost, "lost_groups")):
            out[key] = list(lst)
            lst.clear()
        return out

    def apply_done(marked: dict[str, list[int]]) -> list[int]:
        """Mark dropped or lost ids done (every process: the checkpoint's state); returns them."""
        out = []
        for key, ids in marked.items():
            for i in ids:
                done.add(i)
                summary[key].append(i)
                out.append(i)
        return out

    async def start_rollout_side(stack: contextlib.AsyncExitStack) -> tuple[EnvClient, list[Policy]]:
        """Process 0's rollout side: the environment client (servers started when no URLs are
        given) and the samplers (in process, or replicas by URL or started here)."""
        if r.env_urls:
            urls, token = list(r.env_urls), r.env_token or os.environ.get("COMPOSER_JAX_ENV_TOKEN", "")
        else:
            env_servers = LocalEnvServers(r.tasks_dir, r.env_servers)
            urls, token = stack.enter_context(env_servers)
            echo(f"[rl] started {len(urls)} local environment server(s) on {r.tasks_dir}")
            if r.pin_cores and r.env_cores == "samplers":  # they and their sandboxes share the replicas' cores
                for proc in env_servers.procs:
                    pin_threads(set(sorted(os.sched_getaffinity(0))[1 : 1 + r.local_samplers]), proc.pid)
        client = await stack.enter_async_context(EnvClient(urls, token))
        remote = None
        if r.sampler_urls:
            remote = (list(r.sampler_urls), r.sampler_token or os.environ.get("COMPOSER_JAX_SAMPLER_TOKEN", ""))
        elif r.local_samplers:
            cores = sorted(os.sched_getaffinity(0))
            launcher = LocalSamplers(
                ckpt_cfg.directory,
                r.local_samplers,
                weights_from=store_url,
                poll_interval_s=r.sampler_poll_s,
                cores=cores[1 : 1 + r.local_samplers] if r.pin_cores else None,
                extra_args=["--version", str(start), "--slots", str(r.sampler_slots), "--max-len", str(t.seq_len)]
                + ["--max-queued", "100000", "--prefix-cache", r.sampler_prefix_cache]
                + (["--warm-up"] if r.sampler_warm_up else []),
                log_dir=out_dir / "samplers",
                # a warm-up compiles every (group, bucket) admission program before the replica
                # answers /health: 5-6 min for 48 slots x 768 tokens on one core here, past the
                # plain start's 300 s (a cached compilation loads in seconds)
                start_timeout_s=1800.0 if r.sampler_warm_up else START_TIMEOUT_S,
            )
            remote = stack.enter_context(launcher)
            echo(f"[rl] started {r.local_samplers} sampler replica(s): {', '.join(remote[0])}")
        return client, make_policies(
            cfg, _copy(state.params), tok, version=start, mesh=mesh, rules=rules, remote=remote
        )

    async with contextlib.AsyncExitStack() as stack:
        # the others only train
        rollout_side = await work.run("starting the rollout side", start_rollout_side, stack)
        if rollout_side is not None:
            client, policies = rollout_side
            pool = PolicyPool(policies)
        samplers = _in_process(policies)
        remotes = [p for p in policies if isinstance(p, RemoteTokenPolicy)]
        if r.pin_cores:
            pinned = pin_threads({sorted(os.sched_getaffinity(0))[0]})
            echo(f"[rl] trainer pinned to core {sorted(os.sched_getaffinity(0))[0]} ({pinned} threads)")

        async def load_version(version: int) -> None:
            """Every replica in rotation serves `version` before its groups are sampled."""

            async def one(p: RemoteTokenPolicy) -> None:
                try:
                    await p.load_version(version, store_url)
                except SamplerUnavailable as exc:
                    pool.remove(p, str(exc))

            await asyncio.gather(*(one(p) for p in remotes if p in pool.alive))

        loads: set[asyncio.Future] = set()  # version loads in flight (asynchronous runs)
        stack.push_async_callback(lambda: asyncio.gather(*loads, return_exceptions=True))

        for s in samplers:
            stack.push_async_callback(s.aclose)
        for p in policies:  # policies over other processes hold connections
            if callable(getattr(p, "aclose", None)):
                stack.push_async_callback(p.aclose)  # type: ignore[attr-defined]
        stack.push_async_callback(queue.aclose)

        async def sampler_health() -> list[dict]:
            """Each replica's /health at the end of the step loop (decode steps, slot occupancy)."""
            out = []
            for p in remotes:
                with contextlib.suppress(SamplerUnavailable):
                    out.append(await p.health())
            return out

        async def run_eval(step: int) -> None:
            if not eval_tasks:
                return
            # asynchronous runs: the replicas serve the evaluated version first (its load may be in flight)
            await asyncio.gather(*loads, return_exceptions=True)
            res = await sample_tasks(pool, client, eval_tasks, r.eval_samples, cfg.agent, seed=10_000_019 + r.eval_seed)
            overall = report(res)["overall"]
            ev = {f"eval/{k}": v for k, v in overall.items()}
            # per-rollout outcomes, kept on disk (a resumed run pairs with the step-0 evaluation it
            # did not run): every evaluation uses the same rollout seeds, so a later one is compared
            # with the start pair by pair (rl/evaluate.py::paired_difference)
            outs = outcomes(res)
            outcome_dir.mkdir(parents=True, exist_ok=True)
            (outcome_dir / f"step_{step:06d}.json").write_text(json.dumps(outs) + "\n")
            start_file = outcome_dir / f"step_{0:06d}.json"
            line = f"[rl] step {step} held-out pass@1 {overall['pass@1']:.3f} reward {overall['reward']:.3f}"
            if step > 0 and start_file.exists():
                paired = paired_difference(json.loads(start_file.read_text()), outs)
                ev.update({f"eval/paired_{k}": v for k, v in paired.items()})
                line += f"; paired change from step 0 {format_paired(paired)}"
            summary["evals"].append({"step": step, **ev})
            logger.log(step, ev)
            echo(line)

        async def take(step: int) -> tuple[list[Group], dict[str, Any], dict[str, np.ndarray]]:
            """Process 0: the step's groups, what every process needs of them (ids trained, ids
            dropped or lost, their logged values) and their batch."""
            groups, stale = await queue.take(step, fits)
            marked = mark_done()
            if not groups:
                lost = summary["lost_groups"] + marked["lost_groups"]
                dropped = summary["dropped_stale_groups"] + marked["dropped_stale_groups"]
                raise RuntimeError(
                    f"step {step}: no group left to train (lost: {lost}, dropped as stale: {dropped}); "
                    "see the warnings above"
                )
            if stale:
                echo(f"[rl] step {step + 1}: dropped {len(stale)} stale group(s) {[g.index for g in stale]}")
            rollouts = [
                rl_batch.ScoredRollout(g.index, b.total, [rl_batch.trained_part(x) for x in ro.generations])
                for g in groups
                for ro, b in zip(g.rollouts, g.rewards)
            ]
            host = rl_batch.build_batch(rollouts, cfg)
            lags = [staleness(g, step, r.staleness_unit) for g in groups]
            values = {**step_report(groups), **rl_batch.version_lag(rollouts, step)}
            values.update(
                {
                    "staleness/mean": float(np.mean(lags)),
                    "staleness/max": float(max(lags)),
                    **{f"staleness/groups_{d}": float(lags.count(d)) for d in range(r.max_staleness + 1)},
                    "rl/dropped_stale_groups": float(
                        len(summary["dropped_stale_groups"]) + len(marked["dropped_stale_groups"])
                    ),
                }
            )
            return groups, {"error": "", "groups": [g.index for g in groups], "marked": marked, "values": values}, host

        async def take_shared(step: int) -> tuple[list[Group], dict[str, Any], dict[str, np.ndarray] | None]:
            """`take` on process 0, its header shared with the others (they get no groups and no
            batch: the train step sends it); an error on process 0, in `take` or in its work since
            the last share, stops every process. (Before the share every process waits for the
            last checkpoint's commit: orbax ends an asynchronous save with a barrier that is a device
            collective in its own thread, which must not interleave with this step's.)"""
            taken = await work.run(f"step {step}", take, step)
            header = await asyncio.to_thread(work.share, taken[1] if taken is not None else None)
            if taken is not None:
                return taken[0], header, taken[2]
            return [], header, None

        async def after_step(n: int, trained: int) -> None:
            """Process 0: the replicas to version n, the queue told of it (`trained` groups)."""
            if r.max_staleness == 0:  # the next groups must start on version n
                await load_version(n)
            else:  # replicas take it between decode steps; tokens keep the version that made them
                loads.add(asyncio.ensure_future(load_version(n)))
                loads.difference_update([f for f in loads if f.done()])
            queue.advance(n, trained)

        async def finish() -> None:
            """Process 0 at the end of the run: the queue closed, the replicas' health, the final
            evaluation."""
            await queue.aclose()
            summary["samplers"] = await sampler_health()
            await run_eval(t.steps)

        with jax.set_mesh(mesh):
            if start == 0:
                await work.run("the evaluation at step 0", run_eval, 0)
            await asyncio.to_thread(work.share)  # the setup's end: the others wait for process 0's
            if start < t.steps:
                await asyncio.to_thread(publish, state.params, start)
                work.call("starting the rollout queue", queue.start)
            ran, waited, busy, t_run = 0, 0.0, 0.0, time.perf_counter()
            for step in range(start, t.steps):
                t0 = time.perf_counter()
                groups, header, host = await take_shared(step)
                pending_files += apply_done(header["marked"])
                t1 = time.perf_counter()
                state, values, params = await asyncio.to_thread(train_step, state, host, step)
                n = step + 1
                for s in samplers:
                    s.update_weights(params, n)
                t_load = time.perf_counter()
                await work.run(f"handing version {n} to the samplers", after_step, n, len(groups))
                t2 = time.perf_counter()
                waited, busy = waited + t1 - t0, busy + t2 - t1
                trained = list(header["groups"])
                for i in trained:
                    done.add(i)
                pending_files += trained
                summary["trained_groups"][n] = trained
                values.update(header["values"])
                if lead:
                    values.update(
                        {"queue/ready": float(len(queue.ready)), "queue/in_flight": float(len(queue.in_flight))}
                    )
                values.update(
                    {
                        "time/wait_s": t1 - t0,
                        "time/train_s": t2 - t1,
                        "time/load_wait_s": t2 - t_load,  # waiting for replicas to serve version n
                        "time/step_s": t2 - t0,
                    }
                )
                summary["steps"][n] = values
                if n % t.log_every == 0 or n == t.steps:
                    logger.log(n, values)
                if progress is not None:
                    progress.update(
                        n,
                        f"reward {values['reward/total']:.3f} success {values['rollout/success']:.2f} "
                        f"mismatch-kl {values.get('mismatch_kl_k1', 0.0):.1e}",
                    )
                if r.eval_every and n % r.eval_every == 0 and n != t.steps:
                    await work.run(f"the evaluation at step {n}", run_eval, n)
                if covered and (n % ckpt_cfg.save_every == 0 or n == t.steps):
                    checkpointer.wait()  # the earlier save is committed: the files it covers can go
                    gone = [i for _, ids in covered for i in ids]
                    work.call("removing trained groups' files", store.remove, gone)
                    covered = []
                # (several processes: process 0's data state is the one written, by orbax's primary host)
                data_state = {"next_group": queue.next_index, "done": done.state()}
                if checkpointer.save(n, state, data_state=data_state, config=run_config, force=n == t.steps):
                    covered.append((n, pending_files))
                    pending_files = []
                ran += 1
                summary["wall_s"] = time.perf_counter() - t_run  # of the step loop
                if stop_after is not None and ran >= stop_after:
                    summary["stopped_at"] = n
                    break
            else:
                if t.steps > start:
                    await work.run("the end of the run", finish)
            await asyncio.to_thread(work.share)  # the others stop with an error process 0 had since
    if progress is not None:
        progress.close()
    checkpointer.wait()
    for _, ids in covered:
        if lead:
            store.remove(ids)
    checkpointer.close()
    logger.close()
    summary.setdefault("wall_s", 0.0)
    # the share of the trainer's loop spent waiting for groups (not training, publishing, updating)
    summary["trainer_idle_fraction"] = waited / (waited + busy) if waited + busy > 0 else 0.0
    summary["final_step"] = t.steps
    summary["checkpoint_dir"] = ckpt_cfg.directory
    return summary
