"""Where a run's services run: one interface, `Placement`, and what every placement shares.

A run starts services beside its trainer: environment servers (`rl/rollout/env_servers.py`) and
sampler replicas (`rl/samplers/serve_launch.py`, `vllm_launch.py`). Each is a `ServiceSpec`: what
to run (`argv(host, port)`: `composer-jax` arguments; port 0 is any free port), what it needs
(`Resources`: CPUs, GPUs, a custom resource a cluster operator labels nodes with), how to tell it
is ready (it prints `ready_line` on its stdout, then answers `GET /health` with 200) and healthy
(`/health` every `RestartPolicy.health_interval_s`), and how to restart it (`RestartPolicy`).

A placement starts a list of specs and keeps them up; the learner reads it through `Placement`:
`start()` / `stop()` (also as a context manager), the URLs of what is up (`urls`, `alive_urls`,
`wait_alive`), each service's state (`statuses`: what `rl/rollout/rejoin.py` follows to put a
restarted replica back in rotation, at its new URL if it moved), `restart_counts`, `given_up`,
`metrics`, and `replace` (a planned restart). Two implementations, chosen by `rl.placement`
(`PLACEMENTS`):

* `local` (`runtime/local.py`, `Launcher`): child processes of the run on 127.0.0.1, supervised by
  one thread; the default, and what `make demo` and the tests run.
* `ray` (`runtime/ray_placement.py`, `RayPlacement`): each spec a Ray actor placed on a node that
  has its resources, running the same local supervision of its one child there (bound to the
  node's address); Ray re-places an actor whose node leaves.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Protocol

from composer_jax.config.supervision import SupervisionConfig, policy_problem

START_TIMEOUT_S = 300.0  # the default bound on one service's start (a serve replica reads a checkpoint)
READY_EVENT = "ready"
LOOPBACK = "127.0.0.1"

# a service's states (`ServiceStatus.state`)
STARTING = "starting"  # spawned, waiting for its ready line and /health
ALIVE = "alive"
BACKOFF = "backoff"  # down, to be started again
GIVEN_UP = "given up"
FAILED = "failed"  # its first start failed (the start raises)
STOPPED = "stopped"


class LaunchError(RuntimeError):
    """A service did not start (the reason and its log's tail are in the message), a bad argument, or
    no service alive within a wait's bound."""


def ready_line(url: str, pid: int | None = None) -> str:
    """The line a service prints on its stdout once it serves at `url` (what `parse_ready_line` reads)."""
    return json.dumps({"event": READY_EVENT, "url": url, "pid": os.getpid() if pid is None else pid})


def parse_ready_line(line: str) -> tuple[str, int] | None:
    """(url, pid) of a ready line `{"event": "ready", "url": "http://...", "pid": N}`; None for any
    other line (human-readable lines, logs, JSON of other shapes)."""
    text = line.strip()
    if not text.startswith("{"):
        return None
    try:
        obj = json.loads(text)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("event") != READY_EVENT:
        return None
    url, pid = obj.get("url"), obj.get("pid")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        return None
    if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
        return None
    return url.rstrip("/"), pid


@dataclasses.dataclass(frozen=True)
class RestartPolicy:
    """Restart a service that dies after `backoff_s * 2**k` seconds (at most `max_backoff_s`), k being
    its restarts within the last `window_s` seconds; at `max_restarts` within the window, give up.
    A running service is probed (`GET /health`, each probe bounded by `min(health_interval_s, 5)` s)
    every `health_interval_s` seconds (0: never); after `health_failures` failed probes in a row it
    is killed and restarted as a dead one."""

    max_restarts: int = 5
    window_s: float = 600.0
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    health_interval_s: float = 10.0
    health_failures: int = 3

    def __post_init__(self) -> None:
        problem = policy_problem(self)
        if problem is not None:
            raise LaunchError(problem)

    @property
    def probe_timeout_s(self) -> float:
        """The bound on one health probe of a running service."""
        return float(min(self.health_interval_s, 5.0))

    @classmethod
    def of(cls, c: SupervisionConfig) -> RestartPolicy:
        """The policy a run's `rl.supervision` section sets (validated there)."""
        return cls(c.max_restarts, c.window_s, c.backoff_s, c.max_backoff_s, c.health_interval_s, c.health_failures)

    def delay(self, recent: int) -> float:
        return float(min(self.max_backoff_s, self.backoff_s * 2**recent))


@dataclasses.dataclass(frozen=True)
class Resources:
    """What one service asks a node for (the `ray` placement; `local` runs everything on this
    machine): CPUs, GPUs, and one unit of a custom resource (`custom`, "" for none)."""

    cpus: float = 1.0
    gpus: int = 0
    custom: str = ""

    def as_ray(self) -> dict[str, float]:
        """As Ray counts them ({"CPU": ..., "GPU": ..., custom: 1}), zeros left out."""
        out = {"CPU": float(self.cpus), "GPU": float(self.gpus)}
        if self.custom:
            out[self.custom] = 1.0
        return {k: v for k, v in out.items() if v}


@dataclasses.dataclass(frozen=True)
class ServiceSpec:
    """One supervised service: `argv(host, port)` gives composer-jax's arguments for a service bound
    to `host` (port 0: any free port). For the `ray` placement `argv` must pickle (a module-level
    function or a `Command`, not a closure over a launcher)."""

    name: str  # in logs and errors, e.g. "environment server 0"
    argv: Callable[[str, int], list[str]]
    log_path: Path
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    cores: frozenset[int] | None = None  # `local`: the CPU cores it is pinned to (None: not pinned)
    resources: Resources = dataclasses.field(default_factory=Resources)


@dataclasses.dataclass(frozen=True)
class Command:
    """composer-jax arguments with the tokens "{host}" and "{port}" filled in at each start (a
    `ServiceSpec.argv` that pickles)."""

    args: tuple[str, ...]

    def __call__(self, host: str, port: int) -> list[str]:
        fill = {"{host}": host, "{port}": str(port)}
        return [fill.get(a, a) for a in self.args]


@dataclasses.dataclass(frozen=True)
class ServiceStatus:
    """One service as its placement sees it now. state: starting, alive, backoff, given up, failed
    or stopped; url: where it serves (None before its first start; it changes when the service had to
    move to another port or node); starts: how many of its starts came up (it grows with each
    restart); last_failure: why it last went down (None while it never did)."""

    name: str
    state: str
    url: str | None
    starts: int
    restarts: int
    last_failure: str | None


class Placement(Protocol):
    """What the learner reads of a placement (module docstring)."""

    kind: str
    urls: list[str]

    def start(self) -> list[str]: ...
    def stop(self) -> None: ...
    def alive_urls(self) -> list[str]: ...
    def wait_alive(self, count: int = 1, timeout_s: float = 60.0) -> list[str]: ...
    def restart_counts(self) -> list[int]: ...
    def statuses(self) -> list[ServiceStatus]: ...
    def given_up(self) -> dict[str, str]: ...
    def metrics(self) -> dict[str, float]: ...
    def replace(self, index: int, timeout_s: float, why: str = "asked for") -> str: ...


PLACEMENTS = ("local", "ray")


def log_dir_or_temp(log_dir: str | os.PathLike | None, prefix: str) -> tuple[Path, tempfile.TemporaryDirectory | None]:
    """`log_dir` (created), or a new temporary directory and its handle (to clean up after `stop`)."""
    if log_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix=prefix)
        return Path(tmp.name), tmp
    path = Path(log_dir)
    path.mkdir(parents=True, exist_ok=True)
    return path, None
