"""Environment servers for a run: the given URLs, or local `composer-jax env-server` processes.

With no URLs configured, a run starts its own servers (the embedded default) as child processes
on free ports of 127.0.0.1, with a fresh token, and stops them when it ends. They are separate
processes, as on a cluster: a server that dies costs its sessions only (the agent restarts them),
and `rl.processes.Launcher` restarts the server on its port. They die with the launching process
(the bootstrap's death signal; bubblewrap's `--die-with-parent` takes their sandboxes along).
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Collection
from pathlib import Path

from composer_jax.config.ray import RayConfig
from composer_jax.errors import UserError
from composer_jax.runtime.local import Launcher, check_cores
from composer_jax.runtime.placement import Command, LaunchError, Resources, RestartPolicy, ServiceSpec, log_dir_or_temp
from composer_jax.runtime.ray_placement import RayPlacement

ENV_START_TIMEOUT_S = 120.0  # an env server imports no JAX: it is up in about a second


class EnvServerError(UserError, LaunchError):
    """Local environment servers cannot start (a tasks directory, a token or cores the user gave,
    or servers that die at start: their log says why)."""


class LocalEnvServers(Launcher):
    """`with LocalEnvServers(tasks_dir, count) as (urls, token):` - servers on 127.0.0.1.

    cores: CPU cores for every server and its sandboxes (None: not pinned), out of this process's
    affinity set. extra_args: more `env-server` arguments. log_dir: where `env-server-<i>.log` go
    (default: a temporary directory, removed by `stop`). restart: the restart policy
    (`rl.processes.RestartPolicy`)."""

    def __init__(
        self,
        tasks_dir: str | os.PathLike,
        count: int = 1,
        *,
        token: str | None = None,
        extra_args: tuple[str, ...] = (),
        cores: Collection[int] | None = None,
        log_dir: str | os.PathLike | None = None,
        start_timeout_s: float = ENV_START_TIMEOUT_S,
        restart: RestartPolicy | None = None,
    ):
        self.token = check_env_servers(tasks_dir, count, token, "local")
        pinned = None if cores is None else check_cores(cores, EnvServerError)
        self.tasks_dir, self.count, self.extra = Path(tasks_dir), count, tuple(extra_args)
        self.log_dir, self._tmp = log_dir_or_temp(log_dir, "composer-jax-env-servers-")

        specs = env_server_specs(self.tasks_dir, count, self.token, self.extra, self.log_dir, pinned)
        super().__init__(
            specs, kind="env_servers", start_timeout_s=start_timeout_s, restart=restart, error=EnvServerError
        )

    def __enter__(self) -> tuple[list[str], str]:  # type: ignore[override]
        return self.start(), self.token

    def stop(self) -> None:
        super().stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def check_env_servers(tasks_dir: str | os.PathLike, count: int, token: str | None, where: str) -> str:
    """The checks both placements of environment servers make (`where`: "local" or "Ray-placed");
    the token (`token`, else a fresh one)."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(f"count={count!r} {where} environment servers: give at least 1")
    if not Path(tasks_dir).is_dir():
        raise EnvServerError(f"tasks directory {str(tasks_dir)!r} does not exist or is not a directory")
    if token is not None and len(token) < 16:
        raise EnvServerError("token must be at least 16 characters")
    return token or secrets.token_urlsafe(24)


def env_server_specs(
    tasks_dir: Path,
    count: int,
    token: str,
    extra: tuple[str, ...],
    log_dir: Path,
    cores: frozenset[int] | None = None,
    resources: Resources | None = None,
) -> list[ServiceSpec]:
    """`count` `composer-jax env-server` services on `tasks_dir` sharing `token` (in their
    environment, never on a command line), each bound to the host its placement gives."""
    # absolute: a service placed on another node starts in another directory
    args = ("env-server", "--tasks", str(Path(tasks_dir).resolve()), "--host", "{host}", "--port", "{port}", *extra)
    return [
        ServiceSpec(
            name=f"environment server {i}",
            argv=Command(args),
            log_path=log_dir / f"env-server-{i}.log",
            env={"COMPOSER_JAX_ENV_TOKEN": token},
            cores=cores,
            resources=resources or Resources(),
        )
        for i in range(count)
    ]


class RayEnvServers(RayPlacement):
    """`with RayEnvServers(tasks_dir, count, ray=RayConfig) as (urls, token):` - servers as Ray actors,
    each asking for `rl.ray.env_server_cpus` CPUs and one unit of `rl.ray.env_server_resource`
    (runtime/ray_placement.py); the same servers, token and logs as `LocalEnvServers`."""

    def __init__(
        self,
        tasks_dir: str | os.PathLike,
        count: int = 1,
        *,
        ray: RayConfig,
        token: str | None = None,
        extra_args: tuple[str, ...] = (),
        log_dir: str | os.PathLike | None = None,
        start_timeout_s: float = ENV_START_TIMEOUT_S,
        restart: RestartPolicy | None = None,
    ):
        self.token = check_env_servers(tasks_dir, count, token, "Ray-placed")
        self.log_dir, self._tmp = log_dir_or_temp(log_dir, "composer-jax-env-servers-")
        specs = env_server_specs(
            Path(tasks_dir), count, self.token, tuple(extra_args), self.log_dir, resources=env_server_resources(ray)
        )
        super().__init__(
            specs, ray=ray, kind="env_servers", start_timeout_s=start_timeout_s, restart=restart, error=EnvServerError
        )

    def __enter__(self) -> tuple[list[str], str]:  # type: ignore[override]
        return self.start(), self.token

    def stop(self) -> None:
        super().stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def env_server_resources(ray: RayConfig) -> Resources:
    """What one environment server asks a Ray node for (rl.ray)."""
    return Resources(ray.env_server_cpus, 0, ray.env_server_resource)
