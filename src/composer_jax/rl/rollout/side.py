"""The learner's rollout side (process 0 of a trainer): the environment client, the samplers, the
rollout queue, and version hand-over.

`RolloutSide.start` connects to the environment servers (`rl.env_urls`, or `rl.env_servers` local
ones it starts) and the samplers - one `SamplerBackend` (rl/samplers/base.py): the in-process
continuous-batching sampler, `serve` replicas (`rl.sampler_urls`, or `rl.local_samplers` it starts,
optionally each pinned to its own core with the trainer on another) or vLLM replicas - and builds
the rollout queue (rl/rollout/queue.py) over the task stream from the run's `ResumePoint`: group
`index` is `rl.group_size` rollouts of `task_of(cfg, index)`. The learner asks it for each step's
groups (`take`), which ids finished untrained (`finished_untrained`), and hands it each new policy
version (`hand_over`): the backend is given the weights (`publish`), then its samplers serve the
version (`load`: before its groups start when synchronous, between decode steps when not). It never
asks which backend it has. `Rollouts` is the interface the learner uses, so a step can run against
an in-process stand-in (tests/rl/test_learner_step.py).

No group starts while no environment server answers /health (a dead local server is being
restarted, or remote ones are unreachable): its id waits instead of being spent on rollouts that
cannot run; after `rl.env_wait_s` seconds of that the run fails with an error naming the servers.
A replica taken out of rotation comes back once its supervisor has restarted it and it serves the
current version, and a child restarted on another port is reached there (rl/rollout/rejoin.py);
with none in rotation, rollouts wait for that up to `rl.supervision.rejoin_timeout_s`.

With `rl.reward.judges`, a finished group's rollouts are judged (rl/judges/panel.py) before the
group is persisted and queued: the judged terms join each rollout's reward (`with_judged`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from composer_jax.config import Config
from composer_jax.config.rl import replica_cores
from composer_jax.env.api.client import EnvClient
from composer_jax.rl.algo.rewards import RolloutStats, compose_reward, with_judged
from composer_jax.rl.judges.panel import JudgePanel
from composer_jax.rl.rollout.agent import Rollout, RolloutFailed
from composer_jax.rl.rollout.env_servers import LocalEnvServers, RayEnvServers, env_server_resources
from composer_jax.rl.rollout.group_store import Group, GroupStore
from composer_jax.rl.rollout.ledger import ResumePoint
from composer_jax.rl.rollout.queue import RolloutQueue
from composer_jax.rl.rollout.rejoin import ReplicaWatch
from composer_jax.rl.rollout.tasks import TaskRef, rollout_seed, run_rollouts, sample_tasks
from composer_jax.rl.samplers.base import SamplerBackend
from composer_jax.rl.samplers.engines import SamplerStart, engine_of
from composer_jax.rl.samplers.policy import Policy, PolicyPool
from composer_jax.rl.samplers.serve_launch import sampler_resources
from composer_jax.runtime.placement import Placement, RestartPolicy
from composer_jax.runtime.profile import counters_of

log = logging.getLogger(__name__)

Fits = Callable[[list[Group], Group], bool]
SampleGroup = Callable[[PolicyPool, EnvClient, Config, int], Awaitable[Group]]


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
    rollout whose sampler becomes unavailable is redone on another); rollout i draws on seed
    `rollout_seed(train.seed, index * group_size + i)`."""
    task, g = task_of(cfg, index), cfg.rl.group_size
    jobs = [(task, rollout_seed(cfg.train.seed, index * g + i)) for i in range(g)]
    done: list[Rollout] = []
    failed = 0
    for res in await run_rollouts(policies, client, jobs, cfg.agent):
        if isinstance(res, RolloutFailed):
            log.warning("group %d (%s): %s", index, task.name, res)
            failed += 1
        else:
            done.append(res)
    return Group(index, task, done, [compose_reward(rollout_stats(r), cfg.rl.reward) for r in done], failed)


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


class Rollouts(Protocol):
    """What the learner needs of its rollout side (`RolloutSide`, or a stand-in in a test)."""

    next_index: int  # one past the highest group id started or loaded (the checkpoint's next_group)

    def start_queue(self) -> None: ...

    async def stop_queue(self) -> None: ...

    async def take(self, step: int, fits: Fits) -> tuple[list[Group], list[Group]]: ...

    def finished_untrained(self) -> dict[str, list[int]]: ...

    def queue_values(self) -> dict[str, float]: ...  # logged with each step

    async def hand_over(self, params: Any, version: int, trained: int) -> None: ...

    async def sample_tasks(
        self, tasks: Sequence[TaskRef], samples: int, seed: int
    ) -> dict[TaskRef, list[Rollout | RolloutFailed]]: ...

    async def health(self) -> list[dict]: ...

    async def profile_counters(self) -> dict[str, dict[str, float]]: ...  # runtime/profile.py

    async def aclose(self) -> None: ...


class RolloutSide:
    """Process 0's rollout side (module docstring). Build it with `start`; `samplers` is the run's
    sampler backend, `resume` where its queue starts."""

    def __init__(
        self,
        cfg: Config,
        client: EnvClient,
        samplers: SamplerBackend,
        *,
        resume: ResumePoint,
        store: GroupStore,
        sample_group: SampleGroup = sample_group,
        env_launcher: Placement | None = None,
        sampler_launcher: Placement | None = None,
    ):
        self.cfg, self.client, self.store, self.samplers = cfg, client, store, samplers
        # the local children it supervises (environment servers, replicas)
        self.launchers = [x for x in (env_launcher, sampler_launcher) if x is not None]
        self.pool = PolicyPool(samplers.policies, rejoin_timeout_s=cfg.rl.supervision.rejoin_timeout_s)
        self.version = resume.version  # the newest version handed over (what a rejoining replica loads)
        self.watch = ReplicaWatch(
            self.pool,
            samplers,
            lambda: self.version,
            samplers=sampler_launcher,
            env_servers=env_launcher,
            env_client=client,
        )
        self._watching: asyncio.Future | None = None
        self._sample_group = sample_group
        # the judged behaviour terms' panel (rl.reward.judges); None without judges
        self.judges = JudgePanel(cfg.rl.reward.judges) if cfg.rl.reward.judges else None
        self._loads: set[asyncio.Future] = set()  # version loads in flight (asynchronous runs)
        r = cfg.rl
        self.queue = RolloutQueue(
            sample=self._sample,
            persist=self._persist,
            order=itertools.chain(resume.again, itertools.count(resume.end)),
            ready=resume.ready,
            version=resume.version,
            groups_per_step=r.groups_per_step,
            max_staleness=r.max_staleness,
            unit=r.staleness_unit,
            max_in_flight=r.max_groups_in_flight,
            queue_size=r.queue_size,
            budget=resume.budget,
        )
        self.queue.next_index = max(self.queue.next_index, resume.end)

    @classmethod
    async def start(
        cls,
        stack: contextlib.AsyncExitStack,
        cfg: Config,
        *,
        make_samplers: Callable[..., SamplerBackend],
        policy_args: dict[str, Any],
        checkpoint_dir: str,
        store_url: str,
        out_dir: Path,
        echo: Callable[[str], None],
        **kwargs: Any,
    ) -> RolloutSide:
        """Connect (or start) the environment servers and the samplers; every process and
        connection they hold is closed by `stack`. The samplers are what the run's engine starts
        (rl/samplers/engines.py `engine_of`): `rl.sampler_engine`'s replicas when `rl.sampler_urls`
        or `rl.local_samplers` name some, else in-process ones that `make_samplers(cfg,
        **policy_args)` makes; the rest of `kwargs` go to the constructor."""
        start_ray(stack, cfg, echo)
        urls, token, env_launcher = await _env_servers(stack, cfg, out_dir, echo)
        client = await stack.enter_async_context(EnvClient(urls, token))
        engine = engine_of(cfg)
        samplers, launcher = await engine.start(
            stack,
            SamplerStart(cfg, make_samplers, policy_args, checkpoint_dir, store_url, out_dir, echo),
        )
        side = cls(cfg, client, samplers, env_launcher=env_launcher, sampler_launcher=launcher, **kwargs)
        stack.push_async_callback(side.aclose)
        if cfg.rl.pin_cores and cfg.rl.pin_trainer and engine.pins_trainer:  # (vLLM's launcher pins only its replicas)
            core = sorted(os.sched_getaffinity(0))[0]
            echo(f"[rl] trainer pinned to core {core} ({pin_threads({core})} threads)")
        return side

    @property
    def next_index(self) -> int:
        return self.queue.next_index

    # -- sampling ---------------------------------------------------------------------------------
    async def _sample(self, index: int, version: int) -> Group:
        await self.wait_for_env()
        group = await self._sample_group(self.pool, self.client, self.cfg, index)
        group.version = version
        if self.judges is not None:  # never raises for a judge's faults (neutral terms, counted)
            terms = await self.judges.judge(group.rollouts)
            group.rewards = [with_judged(b, t) for b, t in zip(group.rewards, terms)]
        return group

    async def _persist(self, group: Group) -> None:
        await asyncio.to_thread(self.store.save, group)

    async def wait_for_env(self, poll_s: float = 0.5) -> None:
        """Return once some environment server answers /health; raise after `rl.env_wait_s` s."""
        deadline = time.monotonic() + self.cfg.rl.env_wait_s
        said = False
        while True:
            health = await self.client.health()
            if any("error" not in h for h in health):
                if said:
                    log.warning("an environment server answers again; groups start again")
                return
            if not said:
                log.warning("no environment server answers /health (%s); no group starts meanwhile", health)
                said = True
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"no environment server answered /health for rl.env_wait_s={self.cfg.rl.env_wait_s:g} s: "
                    + "; ".join(f"{h['url']}: {h.get('error')}" for h in health)
                )
            await asyncio.sleep(poll_s)

    def start_queue(self) -> None:
        """The queue started, and beside it the watch that rejoins restarted replicas
        (rl/rollout/rejoin.py)."""
        self.queue.start()
        if self._watching is None:
            self._watching = asyncio.ensure_future(self.watch.run())

    async def stop_queue(self) -> None:
        """No group starts any more; those in flight are cancelled (and the watch stopped)."""
        await self.queue.aclose()
        await self._stop_watching()

    async def _stop_watching(self) -> None:
        if self._watching is not None:
            self._watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watching
            self._watching = None

    async def take(self, step: int, fits: Fits) -> tuple[list[Group], list[Group]]:
        return await self.queue.take(step, fits)

    def finished_untrained(self) -> dict[str, list[int]]:
        """Ids the queue dropped as stale or lost since the last call, by summary key."""
        out: dict[str, list[int]] = {}
        for lst, key in ((self.queue.dropped_stale, "dropped_stale_groups"), (self.queue.lost, "lost_groups")):
            out[key] = list(lst)
            lst.clear()
        return out

    def queue_values(self) -> dict[str, float]:
        """The queue's sizes, the rotation's counts (`samplers/out`, `samplers/rejoined`, ...) and the
        supervised children's (alive, restarts, unresponsive, given up)."""
        out = {"queue/ready": float(len(self.queue.ready)), "queue/in_flight": float(len(self.queue.in_flight))}
        out.update(self.pool.metrics())
        for launcher in self.launchers:
            out.update(launcher.metrics())
        return out

    # -- versions ---------------------------------------------------------------------------------
    async def hand_over(self, params: Any, version: int, trained: int) -> None:
        """Version `version` (= `params`) to the samplers, then the queue told of it (the step before
        it trained `trained` groups)."""
        self.version = version  # a replica rejoining from now on loads this one
        await self.samplers.publish(params, version)
        if self.cfg.rl.max_staleness == 0:  # the next groups must start on this version
            await self.samplers.load(version, self.pool)
        else:  # replicas take it between decode steps; tokens keep the version that made them
            self._loads.add(asyncio.ensure_future(self.samplers.load(version, self.pool)))
            self._loads.difference_update([f for f in self._loads if f.done()])
        self.queue.advance(version, trained)

    async def sample_tasks(
        self, tasks: Sequence[TaskRef], samples: int, seed: int
    ) -> dict[TaskRef, list[Rollout | RolloutFailed]]:
        """An evaluation's rollouts (`rollout/tasks.py::sample_tasks`) on the current version (asynchronous
        runs: the replicas serve it first; its load may be in flight)."""
        await asyncio.gather(*self._loads, return_exceptions=True)
        return await sample_tasks(self.pool, self.client, tasks, samples, self.cfg.agent, seed=seed)

    async def health(self) -> list[dict]:
        """Each sampler's health (decode steps, slot occupancy)."""
        return await self.samplers.health()

    async def profile_counters(self) -> dict[str, dict[str, float]]:
        """The cumulative counters of every sampler and environment server that answers, by service
        (runtime/profile.py): the samplers' from their backend, the environment servers' /metrics parsed."""
        samplers, env = await asyncio.gather(self.samplers.profile_counters(), self.client.metrics())
        out = {f"sampler {k}": v for k, v in samplers.items()}
        for url, text in env.items():
            with contextlib.suppress(ValueError):  # an exposition the parser refuses: left out
                out[f"env {url}"] = counters_of(text)
        return out

    async def aclose(self) -> None:
        """The queue cancelled, version loads awaited (or cancelled, where the backend says so), the
        samplers and their connections closed (idempotent)."""
        await self.queue.aclose()
        await self._stop_watching()
        if self.samplers.cancel_loads_at_close:
            for f in self._loads:
                f.cancel()
        await asyncio.gather(*self._loads, return_exceptions=True)
        await self.samplers.aclose()
        self.pool.policies = []
        if self.judges is not None:
            await self.judges.aclose()


async def _env_servers(stack: contextlib.AsyncExitStack, cfg: Config, out_dir: Path, echo: Callable[[str], None]):
    """The environment servers' URLs and token, and their launcher: `rl.env_urls` (no launcher), or
    local servers started (and supervised: restarted when one dies) here."""
    r = cfg.rl
    if r.env_urls:
        return list(r.env_urls), r.env_token or os.environ.get("COMPOSER_JAX_ENV_TOKEN", ""), None
    cores = None
    if r.pin_cores and r.env_cores == "samplers":  # they and their sandboxes share the replicas' cores
        cores = replica_cores(r, os.sched_getaffinity(0))
    restart = RestartPolicy.of(r.supervision)
    logs = out_dir / "env_servers"
    env_servers: LocalEnvServers | RayEnvServers
    extra = ("--grade-cache", str(r.env_grade_cache)) if r.env_grade_cache else ()
    if r.placement == "ray":
        env_servers = RayEnvServers(
            r.tasks_dir, r.env_servers, ray=r.ray, log_dir=logs, restart=restart, extra_args=extra
        )
    else:
        env_servers = LocalEnvServers(
            r.tasks_dir, r.env_servers, cores=cores, log_dir=logs, restart=restart, extra_args=extra
        )
    urls, token = stack.enter_context(env_servers)
    where = "Ray-placed" if r.placement == "ray" else "local"
    echo(f"[rl] started {len(urls)} {where} environment server(s) on {r.tasks_dir}: {', '.join(urls)}")
    return urls, token, env_servers


def fleet_resources(cfg: Config) -> list[dict[str, float]]:
    """What each service the run places through Ray asks for (rl.placement: ray): its environment
    servers and replicas; none with rl.placement: local or URLs given."""
    r = cfg.rl
    if r.placement != "ray":
        return []
    fleet = [] if r.env_urls else [env_server_resources(r.ray)] * r.env_servers
    fleet += [sampler_resources(r.ray)] * (0 if r.sampler_urls else r.local_samplers)
    return [res.as_ray() for res in fleet]


def start_ray(stack: contextlib.AsyncExitStack, cfg: Config, echo: Callable[[str], None]) -> None:
    """With `rl.placement: ray`, join the cluster (or start a local one holding what the run's
    services ask for: its environment servers and replicas) before any is placed; a local cluster
    ends with the run."""
    r = cfg.rl
    if r.placement != "ray":
        return
    from composer_jax.runtime.ray_placement import connect, import_ray, total

    if connect(r.ray, total(fleet_resources(cfg))):
        stack.callback(import_ray().shutdown)
    ray = import_ray()
    where = "a local Ray cluster" if not (r.ray.address or os.environ.get("RAY_ADDRESS")) else "the Ray cluster"
    echo(f"[rl] placing services on {where} ({len(ray.nodes())} node(s))")
