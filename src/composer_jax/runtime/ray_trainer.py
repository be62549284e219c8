"""The trainer placed by Ray: `--placement ray` on `pretrain`, `sft` and `rl` (`train.placement: ray`).

`run_trainer(cfg, argv)` is what the command does instead of training in its own process:

1. **Join or start a cluster** (`ray_placement.connect`): `train.ray.address`, else `RAY_ADDRESS`
   (`ray job submit` sets it), else a local cluster holding the trainer's hosts and, for an `rl`
   run with `rl.placement: ray`, its environment servers and replicas.
2. **Check, then place.** Every host asks for `train.ray.cpus_per_host` CPUs, `gpus_per_host` GPUs
   and one unit of `resource`; the cluster must have `hosts` alive nodes that each hold one host's
   bundle (else one line naming what is short and what to do, before anything starts). The hosts
   are one placement group, STRICT_SPREAD: one bundle per node, so each trainer process owns its
   node's accelerators. The group must be placed within `start_timeout_s`.
3. **One `TrainerHost` actor per bundle**; host 0's node address and a free port on it become
   `jax.distributed`'s coordinator. Each actor runs, as a child process on its node, the same
   command the user typed with `train.placement=local` (so it trains instead of placing again)
   and `--coordinator ADDR --num-processes N --process-id I` when there are several hosts: the
   same processes `--coordinator` starts by hand, so the same step and the same checkpoints. The
   child dies with its actor (the local launcher's bootstrap: `PR_SET_PDEATHSIG`); it runs in the
   driver's working directory when the node has it (a shared file system, or one machine), else in
   the actor's (a `ray job submit --working-dir` job's files). An `rl` child that places its own
   fleet (`rl.placement: ray`) joins the same cluster (`RAY_ADDRESS` of this one), and its actors
   are the child's: they end when it does.
4. **Follow.** Host 0's output (the process that logs) is printed here as it comes; every host's
   is kept in its actor and its last lines shown when it fails. The first host to fail (a non-zero
   exit, or its actor or node gone) ends the run: the others are killed, the group removed, and the
   exit status is that host's. Ctrl-C here does the same. Nothing outlives the command: the actors
   are this driver's, the children die with them.

Ray is optional (`pip install 'composer-jax[ray]'`); its import happens on first use.
"""

from __future__ import annotations

import collections
import logging
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from composer_jax.config.ray import TrainerRayConfig
from composer_jax.runtime.local import BOOTSTRAP, describe_exit
from composer_jax.runtime.placement import LaunchError
from composer_jax.runtime.ray_placement import actor_error, connect, import_ray, total

log = logging.getLogger(__name__)

_KEEP_LINES = 400  # per host: the output lines an actor keeps for a failure's report


def host_bundle(c: TrainerRayConfig) -> dict[str, float]:
    """What one trainer host asks Ray for, as a placement-group bundle."""
    bundle = {"CPU": float(c.cpus_per_host)}
    if c.gpus_per_host:
        bundle["GPU"] = float(c.gpus_per_host)
    if c.resource:
        bundle[c.resource] = 1.0
    return {k: v for k, v in bundle.items() if v > 0}


def check_hosts(c: TrainerRayConfig, nodes: list[dict], error: type[Exception] = LaunchError) -> None:
    """The cluster has `c.hosts` alive nodes that each hold one host's bundle (STRICT_SPREAD puts
    one per node); else `error` naming what one host asks for, how many nodes have it, and what
    to do."""
    want = host_bundle(c)
    alive = [n for n in nodes if n.get("Alive", n.get("alive", False))]
    fit = [n for n in alive if all(n.get("Resources", {}).get(k, 0.0) >= v for k, v in want.items())]
    if len(fit) >= c.hosts:
        return
    have: dict[str, float] = {}
    for node in alive:
        for key, value in node.get("Resources", {}).items():
            if not key.startswith(("node:", "memory", "object_store")):
                have[key] = have.get(key, 0.0) + float(value)
    hint = (
        f"give {c.hosts} nodes the resource (`ray start --resources='{{\"{c.resource}\": 1}}'`, docs/cluster.md) "
        f"or set train.ray.resource='' for none"
        if c.resource and not any(n.get("Resources", {}).get(c.resource) for n in alive)
        else "add nodes, lower train.ray.hosts, or ask each host for less (train.ray.cpus_per_host, gpus_per_host)"
    )
    raise error(
        f"train.ray.hosts={c.hosts} places one trainer per node, each asking Ray for "
        "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(want.items())) + "}"
        f"; {len(fit)} of the cluster's {len(alive)} alive node(s) can hold one (the cluster has "
        "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(have.items())) + "}"
        f" in all): {hint}"
    )


def host_argv(argv: Sequence[str], index: int, hosts: int, coordinator: str) -> list[str]:
    """Host `index`'s command: the user's `composer-jax` arguments (subcommand first) with the
    trainer placed here (`train.placement=local`) and, with several hosts, joined to the others."""
    out = [*argv, "train.placement=local"]
    if hosts > 1:
        out += ["--coordinator", coordinator, "--num-processes", str(hosts), "--process-id", str(index)]
    return out


class TrainerHost:
    """One trainer process on the node Ray placed this actor on (module docstring); made a Ray
    actor class by `run_trainer` (`ray.remote`), so this module imports without Ray."""

    def __init__(self, index: int):
        import ray

        self.index = index
        self.host = ray.util.get_node_ip_address()
        self.gcs = ray.get_runtime_context().gcs_address
        self.proc: subprocess.Popen | None = None
        self.lines: collections.deque[str] = collections.deque(maxlen=_KEEP_LINES)
        self.out: list[str] = []  # what host 0's driver has not read yet
        self.lock = threading.Lock()

    def coordinator(self) -> str:
        """This node's address and a port free on it now, for `jax.distributed`'s coordinator."""
        with socket.socket() as s:
            s.bind((self.host, 0))
            return f"{self.host}:{s.getsockname()[1]}"

    def run(self, argv: list[str], cwd: str, env: dict[str, str]) -> int:
        """Run `composer-jax ARGV` here to its end; its exit status (negative: killed by a signal)."""
        workdir = cwd if os.path.isdir(cwd) else os.getcwd()
        cmd = [sys.executable, "-c", BOOTSTRAP, "-", str(os.getpid()), *argv]
        child_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1", "RAY_ADDRESS": self.gcs}
        self.proc = subprocess.Popen(
            cmd,
            cwd=workdir,
            env=child_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            errors="replace",
        )
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self.lock:
                self.lines.append(line)
                self.out.append(line)
        return self.proc.wait()

    def read(self) -> str:
        """The output printed since the last call."""
        with self.lock:
            text, self.out = "".join(self.out), []
        return text

    def tail(self, lines: int = 40) -> str:
        with self.lock:
            return "".join(list(self.lines)[-lines:])

    def stop(self, grace_s: float = 10.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def run_trainer(
    c: TrainerRayConfig,
    argv: Sequence[str],
    *,
    fleet: Sequence[Mapping[str, float]] = (),
    echo: Callable[[str], None] = print,
    write: Callable[[str], Any] | None = None,
    poll_s: float = 0.5,
) -> int:
    """Place `c.hosts` trainer processes running `composer-jax ARGV` (module docstring) and follow
    them to the end; the run's exit status. `fleet`: what the run's own services ask Ray for (a
    local cluster is started with room for them)."""
    write = write or (lambda text: sys.stdout.write(text))  # the stdout of the moment (a test's capture)
    bundle = host_bundle(c)
    want = total([*([bundle] * c.hosts), *fleet])
    started = connect(c, want, key="train.ray.address")
    ray = import_ray()
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    group = None
    actors: list[Any] = []
    try:
        check_hosts(c, ray.nodes())
        where = "a local Ray cluster" if started and not (c.address or os.environ.get("RAY_ADDRESS")) else "Ray"
        echo(f"[trainer] placing {c.hosts} trainer host(s) on {where} ({len(ray.nodes())} node(s))")
        name = f"composer-jax-trainer-{os.getpid()}"
        group = placement_group([bundle] * c.hosts, strategy="STRICT_SPREAD", name=name)
        ready, _ = ray.wait([group.ready()], timeout=c.start_timeout_s)
        if not ready:
            raise LaunchError(
                f"the trainer's {c.hosts} host(s) were not placed within train.ray.start_timeout_s="
                f"{c.start_timeout_s:g} s (the cluster has {ray.available_resources()} free): free nodes, or raise "
                "train.ray.start_timeout_s"
            )
        actor_cls = ray.remote(TrainerHost)
        actors = [
            actor_cls.options(
                num_cpus=0,  # the bundle holds the resources; the actor runs in it
                max_restarts=0,
                max_concurrency=4,  # read() and tail() answer while run() runs
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i),
            ).remote(i)
            for i in range(c.hosts)
        ]
        coordinator = ray.get(actors[0].coordinator.remote())
        env = {k: v for k, v in os.environ.items() if k.startswith(("XLA_", "JAX_", "TF_CPP_", "COMPOSER_JAX_"))}
        runs = {
            ray_ref: i
            for i, a in enumerate(actors)
            for ray_ref in [a.run.remote(host_argv(argv, i, c.hosts, coordinator), os.getcwd(), env)]
        }
        return _follow(ray, actors, runs, write, poll_s)
    finally:
        for a in actors:
            try:
                ray.get(a.stop.remote(), timeout=15)
            except Exception:  # its actor or node is gone already
                pass
            try:
                ray.kill(a, no_restart=True)
            except Exception:
                pass
        if group is not None:
            try:
                remove_placement_group(group)
            except Exception:
                pass
        if started:
            ray.shutdown()


def _follow(ray: Any, actors: list[Any], runs: dict[Any, int], write: Callable[[str], Any], poll_s: float) -> int:
    """Print host 0's output until every host has ended; the first failure ends the rest."""
    pending = dict(runs)
    while pending:
        done, _ = ray.wait(list(pending), num_returns=1, timeout=poll_s)
        _drain(ray, actors[0], write)
        for ref in done:
            i = pending.pop(ref)
            try:
                rc = int(ray.get(ref))
                failure = None if rc == 0 else f"trainer host {i} {describe_exit(rc)}"
            except Exception as exc:  # its actor or node died
                rc, failure = 1, f"trainer host {i}: its actor or node was lost ({actor_error(exc)})"
            if failure is not None:
                tail = ""
                if i != 0:
                    try:
                        tail = ray.get(actors[i].tail.remote(), timeout=10)
                    except Exception:
                        pass
                last = f"--- its last lines ---\n{tail}" if tail else ""
                write(f"[trainer] {failure}; stopping the other hosts\n{last}")
                return rc if rc > 0 else 1
    _drain(ray, actors[0], write)
    return 0


def _drain(ray: Any, actor: Any, write: Callable[[str], Any]) -> None:
    try:
        text = ray.get(actor.read.remote(), timeout=10)
    except Exception:
        return
    if text:
        write(text)
        flush = getattr(sys.stdout, "flush", None)
        if flush is not None:
            flush()
