"""The `ray` placement (runtime/placement.py): each service a Ray actor on a node that has its resources.

`RayPlacement(specs, ray=RayConfig)` places every `ServiceSpec` as a `ServiceActor`, asking Ray for
the spec's `Resources` (CPUs, GPUs, one unit of a custom resource such as `env_server` that a
cluster operator puts on the nodes meant for it). The actor runs on its node what the `local`
placement runs on this one: a `runtime.local.Launcher` of its one service, bound to the node's
address, with the same readiness (ready line, then `/health`), restarts and health probes under the
run's `RestartPolicy`. What Ray adds is the node: an actor whose process or node dies is placed
again by Ray (`max_restarts` from the same policy) on a node that has the resources, where it
starts its service afresh, at a new URL. The placement follows: a thread asks every actor for its
service's state every `poll_s`; a service that moved is updated in place in `urls` and shows in
`statuses()` with more starts, which is what the rollout side (rl/rollout/rejoin.py) follows to put
a replica back in rotation and to move the environment client to a server's new address.

The actors are the driver's (not detached): when the run's process ends, however it ends, Ray ends
them, and each one's service dies with it (the launcher's death signal), so nothing outlives the
run. `stop()` stops each service and kills its actor.

Ray is optional (`pip install 'composer-jax[ray]'`, locks/ray.lock; `make venv` installs it): the
import happens here, on first use, and a missing Ray, an address with no cluster, or a resource no
node has is a one-line error naming what to do, before any service starts. `connect` joins
`rl.ray.address` (or `RAY_ADDRESS`), else starts a local cluster that has the custom resources the
run asks for, so `--placement ray` works on one machine.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from composer_jax.config.ray import RayConfig, TrainerRayConfig
from composer_jax.runtime.local import Launcher
from composer_jax.runtime.placement import (
    ALIVE,
    BACKOFF,
    GIVEN_UP,
    START_TIMEOUT_S,
    STOPPED,
    LaunchError,
    RestartPolicy,
    ServiceSpec,
    ServiceStatus,
)

log = logging.getLogger(__name__)

NO_RAY = "rl.placement: ray needs Ray: pip install 'composer-jax[ray]' (`make venv` installs it: locks/ray.lock)"


def import_ray() -> Any:
    """The `ray` module, or LaunchError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise LaunchError(NO_RAY) from None
    return ray


def connect(
    cfg: RayConfig | TrainerRayConfig, resources: Mapping[str, float] | None = None, key: str = "rl.ray.address"
) -> bool:
    """Join the cluster `cfg.address` (or RAY_ADDRESS) names, or start a local one with at least
    `resources` (custom resources and CPUs the run's services ask for; a local cluster counts CPUs
    as scheduling slots, not cores). True when this call started Ray (the caller shuts it down)."""
    ray = import_ray()
    if ray.is_initialized():
        return False
    address = cfg.address or os.environ.get("RAY_ADDRESS", "")
    quiet = {"logging_level": logging.WARNING, "log_to_driver": False, "namespace": cfg.namespace}
    if address:
        where = key
        key = key if cfg.address else "RAY_ADDRESS"
        _reachable(address, key, where)
        try:
            ray.init(address=address, **quiet)
        except (ConnectionError, RuntimeError, ValueError) as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise LaunchError(
                f"{key}={address!r}: no Ray cluster to join there ({first}); start one "
                f"(`ray start --head`, docs/cluster.md) or leave {where} and RAY_ADDRESS empty for a local one"
            ) from None
        return True
    want = dict(resources or {})
    cpus = max(os.cpu_count() or 1, math.ceil(want.pop("CPU", 0.0)))
    want.pop("GPU", None)  # a local cluster has the GPUs Ray finds
    ray.init(num_cpus=cpus, resources={k: float(v) for k, v in want.items()}, include_dashboard=False, **quiet)
    return True


def _reachable(address: str, key: str, where: str = "rl.ray.address", timeout_s: float = 5.0) -> None:
    """A HOST:PORT (or ray://HOST:PORT) address answers a TCP connection: Ray's own join retries an
    address with nothing behind it for minutes. "auto" and other forms are left to Ray."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit() or not host:
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as exc:
        raise LaunchError(
            f"{key}={address!r}: no Ray cluster to join there ({exc}); start one (`ray start --head`, "
            f"docs/cluster.md) or leave {where} and RAY_ADDRESS empty for a local one"
        ) from None


def total(resources: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """The sum of resource dicts (Ray's names: CPU, GPU, custom resources), key by key."""
    out: dict[str, float] = {}
    for res in resources:
        for key, value in res.items():
            out[key] = out.get(key, 0.0) + value
    return out


def demand(specs: Sequence[ServiceSpec]) -> dict[str, float]:
    """The sum of what `specs` ask for, as Ray counts it."""
    return total(spec.resources.as_ray() for spec in specs)


def check_resources(specs: Sequence[ServiceSpec], nodes: list[dict], error: type[Exception] = LaunchError) -> None:
    """Each spec fits some alive node (its total resources), and the alive nodes together hold what
    all specs ask for; else `error` naming the resource, what the cluster has, and what to do."""
    alive = [n for n in nodes if n.get("Alive", n.get("alive", False))]
    have: dict[str, float] = {}
    for node in alive:
        for key, value in node.get("Resources", {}).items():
            have[key] = have.get(key, 0.0) + float(value)
    for spec in specs:
        want = spec.resources.as_ray()
        if not any(all(n.get("Resources", {}).get(k, 0.0) >= v for k, v in want.items()) for n in alive):
            missing = [k for k, v in want.items() if have.get(k, 0.0) < v] or sorted(want)
            raise error(
                f"{spec.name} asks Ray for {_fmt(want)}, which no node of the cluster has (short of "
                f"{', '.join(missing)}; the cluster has {_fmt(_visible(have))}); give nodes the resource "
                "(`ray start --resources='{\"" + (spec.resources.custom or missing[0]) + "\": 8}'`, docs/cluster.md) "
                "or change rl.ray (e.g. rl.ray.env_server_resource='' for none)"
            )
    total = demand(specs)
    short = [f"{k} ({v:g} asked, {have.get(k, 0.0):g} there)" for k, v in sorted(total.items()) if have.get(k, 0.0) < v]
    if short:
        raise error(
            f"the services ask Ray for {_fmt(total)} in all; the cluster has {_fmt(_visible(have))}, short of "
            f"{', '.join(short)}: add nodes, or run fewer services (rl.env_servers, rl.local_samplers)"
        )


def _visible(resources: Mapping[str, float]) -> dict[str, float]:
    return {k: v for k, v in resources.items() if not k.startswith(("node:", "memory", "object_store"))}


def _fmt(resources: Mapping[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(resources.items())) + "}"


class ServiceActor:
    """One service on the node Ray placed this actor on (module docstring); made a Ray actor class
    by `RayPlacement` (`ray.remote`), so this module imports without Ray."""

    def __init__(self, spec: ServiceSpec, kind: str, start_timeout_s: float, restart: RestartPolicy):
        import ray

        self.node = ray.get_runtime_context().get_node_id()
        self.incarnation = uuid.uuid4().hex  # a new one each time Ray places this actor again
        host = ray.util.get_node_ip_address()
        log_path = spec.log_path
        try:
            log_path.parent.mkdir(parents=True, exist_ok=True)
        except OSError:  # the run's directory is not on this node: the node's temporary directory
            log_path = Path(os.environ.get("TMPDIR", "/tmp")) / "composer-jax" / kind / spec.log_path.name
        spec = dataclasses.replace(spec, cores=None, log_path=log_path)
        self.launcher = Launcher([spec], kind=kind, host=host, start_timeout_s=start_timeout_s, restart=restart)
        self.launcher.start()  # raises when the first start fails: the actor dies, not restarted

    def status(self) -> dict[str, Any]:
        (st,) = self.launcher.statuses()
        return {
            **dataclasses.asdict(st),
            "node": self.node,
            "incarnation": self.incarnation,
            "unresponsive": self.launcher.metrics()[f"{self.launcher.kind}/unresponsive"],
        }

    def replace(self, timeout_s: float, why: str) -> str:
        return self.launcher.replace(0, timeout_s, why)

    def stop(self) -> None:
        self.launcher.stop()


@dataclasses.dataclass
class _Placed:
    spec: ServiceSpec
    actor: Any = None
    state: str = STOPPED
    url: str | None = None
    node: str | None = None
    incarnation: str | None = None
    inner: dict[str, Any] = dataclasses.field(default_factory=dict)  # the actor's last answer
    base_starts: int = 0  # starts and restarts of earlier incarnations (earlier nodes)
    base_restarts: int = 0
    base_unresponsive: float = 0.0
    moves: int = 0  # times Ray placed it again (its process or node died)
    reason: str | None = None  # why it was given up on
    last_failure: str | None = None

    def starts(self) -> int:
        return self.base_starts + int(self.inner.get("starts", 0))

    def restarts(self) -> int:
        return self.base_restarts + int(self.inner.get("restarts", 0))


class RayPlacement:
    """Services from `specs` as Ray actors (module docstring); the `Placement` interface.

    `urls[i]` is service i's URL; the list object stays the same for the placement's life (a service
    that moved to another node or port is updated in place)."""

    def __init__(
        self,
        specs: Sequence[ServiceSpec],
        *,
        ray: RayConfig | None = None,
        kind: str = "services",
        start_timeout_s: float = START_TIMEOUT_S,
        restart: RestartPolicy | None = None,
        error: type[Exception] = LaunchError,
        grace_s: float = 10.0,
        poll_s: float = 1.0,
    ):
        if not specs:
            raise error("no services to place: give at least one ServiceSpec")
        self.cfg = ray or RayConfig()
        self.kind, self.start_timeout_s, self.error = kind, float(start_timeout_s), error
        self.restart = RestartPolicy() if restart is None else restart
        self.grace_s, self.poll_s = grace_s, poll_s
        self._placed = [_Placed(s) for s in specs]
        self.urls: list[str] = []
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started_ray = False

    # ------------------------------------------------------------------ start and stop
    def start(self) -> list[str]:
        """Connect to Ray, check the cluster has what every service asks for, place them, and wait
        until each is up (`start_timeout_s` each, placing included); the placement's error, and
        nothing left running, when one is not."""
        if self._thread is not None:
            raise self.error(f"these {self.kind} were started already (a placement starts once)")
        try:
            self._started_ray = connect(self.cfg, demand([p.spec for p in self._placed]))
            ray = import_ray()
            check_resources([p.spec for p in self._placed], ray.nodes(), self.error)
            actor_cls = ray.remote(ServiceActor)
            for i, p in enumerate(self._placed):
                res = p.spec.resources
                p.actor = actor_cls.options(
                    num_cpus=res.cpus,
                    num_gpus=res.gpus,
                    resources={res.custom: 1.0} if res.custom else None,
                    max_restarts=self.restart.max_restarts,
                    max_task_retries=0,
                    max_concurrency=4,  # status() answers while a replace() waits
                    name=f"{self.kind}-{i}-{uuid.uuid4().hex[:8]}",
                ).remote(p.spec, self.kind, self.start_timeout_s, self.restart)
                p.state = BACKOFF
            self._wait_first(ray)
        except BaseException:
            self.stop()
            raise
        self._thread = threading.Thread(target=self._watch, name=f"composer-jax {self.kind} ray watch", daemon=True)
        self._thread.start()
        return self.urls

    def _wait_first(self, ray: Any) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        pending = {i: p.actor.status.remote() for i, p in enumerate(self._placed)}
        while pending:
            left = deadline - time.monotonic()
            ready, _ = ray.wait(list(pending.values()), num_returns=1, timeout=max(0.0, left))
            if not ready:
                names = ", ".join(self._placed[i].spec.name for i in pending)
                raise self.error(
                    f"{names}: not up within start_timeout_s={self.start_timeout_s:g} s (placed on no node yet, "
                    f"or starting; the cluster has {_fmt(_visible(ray.available_resources()))} free)"
                )
            i = next(k for k, ref in pending.items() if ref == ready[0])
            del pending[i]
            try:
                answer = ray.get(ready[0])
            except Exception as exc:  # the actor's __init__ raised: its service's first start failed
                raise self.error(f"{self._placed[i].spec.name} did not start: {actor_error(exc)}") from None
            with self._lock:
                self._seen(self._placed[i], answer)
        with self._lock:
            self.urls.extend(p.url or "" for p in self._placed)

    def stop(self) -> None:
        """Stop every service (each actor stops its child) and kill the actors; no restarts after."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
        try:
            ray = import_ray()
        except LaunchError:
            return
        if not ray.is_initialized():
            return
        stops = [(p, p.actor.stop.remote()) for p in self._placed if p.actor is not None]
        if stops:
            ray.wait([ref for _, ref in stops], num_returns=len(stops), timeout=self.grace_s)
        for p, _ in stops:
            try:
                ray.kill(p.actor, no_restart=True)
            except Exception:  # already dead
                pass
            p.actor, p.state = None, STOPPED if p.state != GIVEN_UP else p.state
        if self._started_ray:
            ray.shutdown()
            self._started_ray = False

    def __enter__(self) -> list[str]:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ following the actors
    def _watch(self) -> None:
        ray = import_ray()
        while not self._stop.wait(self.poll_s):
            for p in self._placed:
                if self._stop.is_set():
                    return
                if p.state == GIVEN_UP or p.actor is None:
                    continue
                try:
                    answer = ray.get(p.actor.status.remote(), timeout=max(self.poll_s, 5.0))
                except Exception as exc:
                    with self._lock:
                        self._down(p, exc, ray)
                    continue
                with self._lock:
                    self._seen(p, answer)

    def _seen(self, p: _Placed, answer: dict[str, Any]) -> None:
        if p.incarnation is not None and answer["incarnation"] != p.incarnation:
            # Ray placed the actor again: fold the old incarnation's counts in, count the move
            p.base_starts += int(p.inner.get("starts", 0))
            p.base_restarts += int(p.inner.get("restarts", 0)) + 1
            p.base_unresponsive += float(p.inner.get("unresponsive", 0.0))
            p.moves += 1
            log.warning("%s: %s placed again by Ray, on node %s", self.kind, p.spec.name, answer["node"][:12])
        p.incarnation, p.node, p.inner = answer["incarnation"], answer["node"], answer
        if answer.get("last_failure"):
            p.last_failure = answer["last_failure"]
        url = answer.get("url")
        if url and url != p.url and p.url in self.urls:
            log.warning("%s: %s moved from %s to %s", self.kind, p.spec.name, p.url, url)
            self.urls[self.urls.index(p.url)] = url
        p.url = url or p.url
        p.state = answer["state"]
        if p.state == GIVEN_UP:
            p.reason = answer.get("last_failure") or f"{p.spec.name} given up on its node"

    def _down(self, p: _Placed, exc: BaseException, ray: Any) -> None:
        """The actor did not answer: its process or node is gone (Ray places it again while it has
        restarts left) or it is busy past the bound."""
        why = actor_error(exc)
        if isinstance(exc, ray.exceptions.ActorDiedError) and "restart" not in why.lower():
            if p.state != GIVEN_UP:
                p.state = GIVEN_UP
                p.reason = f"{p.spec.name} given up: its actor died and Ray has no restart left ({why})"
                log.error("%s: %s", self.kind, p.reason)
            return
        if p.state == ALIVE:
            p.last_failure = f"{p.spec.name} on node {(p.node or '?')[:12]}: {why}"
            log.warning("%s: %s", self.kind, p.last_failure)
        p.state = BACKOFF

    # ------------------------------------------------------------------ the learner's API
    def alive_urls(self) -> list[str]:
        with self._lock:
            return [p.url for p in self._placed if p.state == ALIVE and p.url]

    def wait_alive(self, count: int = 1, timeout_s: float = 60.0) -> list[str]:
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= len(self._placed):
            raise self.error(f"count={count!r}; accepted: an int from 1 to {len(self._placed)}")
        deadline = time.monotonic() + timeout_s
        while len(alive := self.alive_urls()) < count and time.monotonic() < deadline:
            time.sleep(min(0.1, self.poll_s))
        if len(alive) >= count:
            return alive
        with self._lock:
            states = "; ".join(f"{p.spec.name}: {p.reason or p.state}" for p in self._placed)
        raise self.error(
            f"{len(alive)} of {len(self._placed)} {self.kind} alive after {timeout_s:g} s, {count} wanted ({states})"
        )

    def restart_counts(self) -> list[int]:
        with self._lock:
            return [p.restarts() for p in self._placed]

    def statuses(self) -> list[ServiceStatus]:
        with self._lock:
            return [
                ServiceStatus(p.spec.name, p.state, p.url, p.starts(), p.restarts(), p.last_failure)
                for p in self._placed
            ]

    def given_up(self) -> dict[str, str]:
        with self._lock:
            return {p.spec.name: p.reason for p in self._placed if p.state == GIVEN_UP and p.reason}

    def metrics(self) -> dict[str, float]:
        """The local placement's keys (`{kind}/alive`, `/restarts`, `/given_up`, `/unresponsive`,
        `/restarts_<i>`) and `{kind}/moved`: times Ray placed a service again."""
        counts = self.restart_counts()
        with self._lock:
            unresponsive = sum(p.base_unresponsive + float(p.inner.get("unresponsive", 0.0)) for p in self._placed)
            moved = sum(p.moves for p in self._placed)
        out = {
            f"{self.kind}/alive": float(len(self.alive_urls())),
            f"{self.kind}/restarts": float(sum(counts)),
            f"{self.kind}/given_up": float(len(self.given_up())),
            f"{self.kind}/unresponsive": float(unresponsive),
            f"{self.kind}/moved": float(moved),
        }
        out.update({f"{self.kind}/restarts_{i}": float(n) for i, n in enumerate(counts)})
        return out

    def replace(self, index: int, timeout_s: float, why: str = "asked for") -> str:
        """Stop service `index` and start it again where it is (its actor's launcher does it)."""
        if not 0 <= index < len(self._placed) or self._placed[index].actor is None:
            raise self.error(
                f"replace({index!r}): give a service index from 0 to {len(self._placed) - 1} of a started placement"
            )
        ray = import_ray()
        p = self._placed[index]
        try:
            url = ray.get(p.actor.replace.remote(timeout_s, why), timeout=timeout_s + 30.0)
        except Exception as exc:
            raise self.error(
                f"{p.spec.name} did not come back within {timeout_s:g} s ({why}): {actor_error(exc)}"
            ) from None
        with self._lock:
            if p.url in self.urls and url != p.url:
                self.urls[self.urls.index(p.url)] = url
            p.url, p.state = url, ALIVE
        return url


def actor_error(exc: BaseException) -> str:
    """What an actor raised, as its message (Ray wraps it in its own error, after the remote
    traceback), or the first line of Ray's own error."""
    text = str(exc).strip()
    tail = text[text.rfind('\n  File "') :] if '\n  File "' in text else ""
    raised = re.search(r"^[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)\w*: ", tail, re.M)
    if raised:
        return tail[raised.end() :].strip()[:4000]
    return (text.splitlines() or [type(exc).__name__])[0][:500]
