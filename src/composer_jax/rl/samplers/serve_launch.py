"""The serve backend's start: `rl.sampler_urls` replicas by URL, or K `composer-jax serve` child
processes on one machine (`rl.local_samplers`), as the run's `ServeReplicas` (`start_serve`).

`LocalSamplers` is the sampler-side twin of `rl.rollout.env_servers.LocalEnvServers`, both
configurations of `runtime.local.Launcher`: it starts `count` replicas of `composer-jax serve`
over one checkpoint, each a separate process (as samplers on separate accelerators would be),
optionally pinned to its own CPU core (by the launcher's bootstrap, before the child imports
anything), on free ports of 127.0.0.1, sharing one generated API key, each following the run's
weight-sync store (`--weights-from`), and waits until every replica has printed its ready line and
answers /health. The learner talks to them through `rl.samplers.serve.RemoteTokenPolicy(url, key,
...)`. A replica that dies is restarted on its port (`runtime.placement.RestartPolicy`).

Teardown leaves no process behind: `stop()` (also on an exception inside the `with` block or while
starting) terminates every replica, waits, and kills what is left; each child also asks the kernel
to send it SIGTERM when the launching process dies (Linux `PR_SET_PDEATHSIG`; the launcher starts
every child from its supervisor thread, which lives as long as the launcher), so not even a killed
launcher orphans its replicas. Each replica's output goes to `log_dir/sampler-<i>.log`.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path

from composer_jax.config import Config
from composer_jax.config.ray import RayConfig
from composer_jax.config.rl import replica_cores
from composer_jax.config.sampler import SERVE_SAMPLER, SamplerConfig, sampler_argv, validate_sampler
from composer_jax.errors import ConfigError
from composer_jax.formats.tokenizer import Tokenizer
from composer_jax.rl.samplers.serve import ServeReplicas
from composer_jax.runtime.local import Launcher
from composer_jax.runtime.placement import (
    START_TIMEOUT_S,
    Command,
    LaunchError,
    Resources,
    RestartPolicy,
    ServiceSpec,
    log_dir_or_temp,
)
from composer_jax.runtime.ray_placement import RayPlacement


class SamplerLaunchError(LaunchError):
    """A replica did not start (its log's tail is in the message) or an argument is out of range."""


class LocalSamplers(Launcher):
    """`with LocalSamplers(checkpoint, count, weights_from=URL) as (urls, key):` - replicas on 127.0.0.1.

    sampler: every replica's sampler settings (config/sampler.py; `serve`'s flags are written from
    it). cores: one CPU core per replica to pin it to (None: not pinned); the cores must be in this
    process's affinity set. extra_args: more `serve` arguments (e.g. ("--max-len", "4096")), after
    the sampler's (a repeated flag overrides).
    start_timeout_s bounds each replica's start (JAX import, checkpoint read, and with
    `--warm-up` the compilation of its admission programs). restart: the restart policy."""

    def __init__(
        self,
        checkpoint: str | os.PathLike,
        count: int = 1,
        *,
        weights_from: str | None = None,
        sampler: SamplerConfig = SERVE_SAMPLER,
        cores: Sequence[int] | None = None,
        api_key: str | None = None,
        extra_args: Sequence[str] = (),
        log_dir: str | os.PathLike | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
        restart: RestartPolicy | None = None,
    ):
        check_replicas(checkpoint, count)
        if cores is not None:
            allowed = os.sched_getaffinity(0)
            if len(cores) != count or len(set(cores)) != count or not set(cores) <= allowed:
                raise SamplerLaunchError(
                    f"cores={list(cores)!r}: give {count} distinct cores out of this process's {sorted(allowed)}"
                )
        try:
            validate_sampler(sampler, "sampler")
        except ConfigError as e:
            raise SamplerLaunchError(str(e)) from None
        if api_key is not None and len(api_key) < 16:
            raise SamplerLaunchError("api_key must be at least 16 characters")
        self.checkpoint, self.count, self.weights_from = Path(checkpoint), count, weights_from
        self.sampler, self.cores, self.extra = sampler, cores, tuple(extra_args)
        self.api_key = api_key or secrets.token_urlsafe(32)
        self.log_dir, self._tmp = log_dir_or_temp(log_dir, "composer-jax-samplers-")

        specs = serve_specs(
            self.checkpoint, count, self.api_key, self.sampler, self.weights_from, self.extra, self.log_dir, cores
        )
        super().__init__(
            specs, kind="samplers", start_timeout_s=start_timeout_s, restart=restart, error=SamplerLaunchError
        )

    def __enter__(self) -> tuple[list[str], str]:  # type: ignore[override]
        return self.start(), self.api_key

    def stop(self) -> None:
        """Terminate every replica (SIGTERM, then SIGKILL after 10 s) and wait for each."""
        super().stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


class RaySamplers(RayPlacement):
    """`with RaySamplers(checkpoint, count, ray=RayConfig, weights_from=URL) as (urls, key):` - serve
    replicas as Ray actors, each asking for `rl.ray.sampler_cpus` CPUs, `rl.ray.sampler_gpus` GPUs
    and one unit of `rl.ray.sampler_resource` (runtime/ray_placement.py); the same replicas, key and
    logs as `LocalSamplers`. The checkpoint and the weight store must be readable at the same path
    (a shared file system or gs://) on every node a replica may be placed on."""

    def __init__(
        self,
        checkpoint: str | os.PathLike,
        count: int = 1,
        *,
        ray: RayConfig,
        weights_from: str | None = None,
        sampler: SamplerConfig = SERVE_SAMPLER,
        api_key: str | None = None,
        extra_args: Sequence[str] = (),
        log_dir: str | os.PathLike | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
        restart: RestartPolicy | None = None,
    ):
        check_replicas(checkpoint, count)
        self.api_key = api_key or secrets.token_urlsafe(32)
        self.log_dir, self._tmp = log_dir_or_temp(log_dir, "composer-jax-samplers-")
        specs = serve_specs(
            Path(checkpoint),
            count,
            self.api_key,
            sampler,
            weights_from,
            tuple(extra_args),
            self.log_dir,
            resources=sampler_resources(ray),
        )
        super().__init__(
            specs, ray=ray, kind="samplers", start_timeout_s=start_timeout_s, restart=restart, error=SamplerLaunchError
        )

    def __enter__(self) -> tuple[list[str], str]:  # type: ignore[override]
        return self.start(), self.api_key

    def stop(self) -> None:
        super().stop()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None


def check_replicas(checkpoint: str | os.PathLike, count: int) -> None:
    """The checks both placements of serve replicas make."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise SamplerLaunchError(f"count={count!r} sampler replicas: give an int >= 1")
    if not Path(checkpoint).exists():
        raise SamplerLaunchError(f"checkpoint {str(checkpoint)!r} does not exist")


def sampler_resources(ray: RayConfig) -> Resources:
    """What one serve replica asks a Ray node for (rl.ray)."""
    return Resources(ray.sampler_cpus, ray.sampler_gpus, ray.sampler_resource)


def serve_specs(
    checkpoint: Path,
    count: int,
    api_key: str,
    sampler: SamplerConfig,
    weights_from: str | None,
    extra: tuple[str, ...],
    log_dir: Path,
    cores: Sequence[int] | None = None,
    resources: Resources | None = None,
) -> list[ServiceSpec]:
    """`count` `composer-jax serve` replicas over `checkpoint` sharing `api_key` (in their environment),
    each following `weights_from` when given and bound to the host its placement gives."""
    args = ["serve", "--checkpoint", str(checkpoint.resolve()), "--host", "{host}", "--port", "{port}"]
    args += sampler_argv(sampler)
    if weights_from is not None:
        args += ["--weights-from", weights_from]
    return [
        ServiceSpec(
            name=f"sampler replica {i} ({checkpoint})",
            argv=Command((*args, *extra)),
            log_path=log_dir / f"sampler-{i}.log",
            env={"COMPOSER_JAX_API_KEY": api_key},
            cores=None if cores is None else frozenset([cores[i]]),
            resources=resources or Resources(),
        )
        for i in range(count)
    ]


def local_samplers(
    cfg: Config, checkpoint_dir: str, store_url: str, version: int, out_dir: Path
) -> LocalSamplers | RaySamplers:
    """`rl.local_samplers` serve replicas over the run's checkpoint of step `version`, following the
    weight store: child processes of the run, or Ray actors with `rl.placement: ray`."""
    r, t = cfg.rl, cfg.train
    extra = ["--version", str(version), "--max-len", str(t.seq_len)]
    # a warm-up compiles every (group, bucket) admission program before the replica answers
    # /health: 5-6 min for 48 slots x 768 tokens on one core here, past the plain start's 300 s
    # (a cached compilation loads in seconds)
    timeout = 1800.0 if r.sampler.warm_up else START_TIMEOUT_S
    restart = RestartPolicy.of(r.supervision)
    if r.placement == "ray":
        return RaySamplers(
            checkpoint_dir,
            r.local_samplers,
            ray=r.ray,
            weights_from=store_url,
            sampler=r.sampler,
            extra_args=extra,
            log_dir=out_dir / "samplers",
            restart=restart,
            start_timeout_s=timeout,
        )
    return LocalSamplers(
        checkpoint_dir,
        r.local_samplers,
        weights_from=store_url,
        sampler=r.sampler,
        cores=replica_cores(r, os.sched_getaffinity(0)),
        extra_args=extra,
        log_dir=out_dir / "samplers",
        restart=restart,
        start_timeout_s=timeout,
    )


def start_serve(
    stack: contextlib.ExitStack | contextlib.AsyncExitStack,
    cfg: Config,
    tok: Tokenizer,
    *,
    version: int,
    checkpoint_dir: str,
    store_url: str,
    out_dir: Path,
    echo: Callable[[str], None],
) -> tuple[ServeReplicas, LocalSamplers | RaySamplers | None]:
    """The run's serve replicas: `rl.sampler_urls` (no launcher), or `rl.local_samplers` started here
    over the run's checkpoint of step `version` (stopped by `stack`), with their launcher."""
    r = cfg.rl
    launcher = None
    if r.sampler_urls:
        urls, key = list(r.sampler_urls), r.sampler_token or os.environ.get("COMPOSER_JAX_SAMPLER_TOKEN", "")
    else:
        launcher = local_samplers(cfg, checkpoint_dir, store_url, version, out_dir)
        urls, key = stack.enter_context(launcher)
        echo(f"[rl] started {r.local_samplers} sampler replica(s): {', '.join(urls)}")
    return ServeReplicas.connect(urls, key, tok, max_context=cfg.train.seq_len, store_url=store_url), launcher
