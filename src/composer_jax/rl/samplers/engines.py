"""The sampler engines: what samples a run's rollouts, one registry entry each (`ENGINES`), picked
from the config by `engine_of`: "in-process" when no replicas are named (neither `rl.sampler_urls`
nor `rl.local_samplers`), else `rl.sampler_engine` ("serve" or "vllm": config/rl.py's
`SAMPLER_ENGINES`, the names of the engines that have replicas; tests/rl/samplers/test_engines.py
holds them equal).

Each `SamplerEngine` declares what the run starts for it (`places`), what weight transfer it needs
(`weight_store`: none, the in-process sampler shares the trainer's arrays; the tensorstore weight
store serve replicas follow, `OUT_DIR/weight_store` unless `rl.weight_store` names one when the run
starts the replicas; vLLM's own, a restart on an exported checkpoint or NCCL), whether the rollout
side pins the trainer beside its replicas under `rl.pin_cores` (`pins_trainer`: serve; vLLM's
launcher pins only its replicas), whether replicas the run starts load the run's step checkpoint
(`starts_on_checkpoint`: serve, so the learner writes one first), and `start`, which returns the
run's `SamplerBackend` and the placement of the replicas it started (None when it started none).
The learner and the rollout side ask the engine these things and never compare its name; vLLM's
code is imported only when its engine starts.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal

from composer_jax.config import Config
from composer_jax.errors import ConfigError
from composer_jax.rl.samplers.base import SamplerBackend
from composer_jax.rl.samplers.serve_launch import start_serve
from composer_jax.runtime.placement import Placement

Places = Literal["nothing", "serve replicas", "vllm replicas"]
WeightStore = Literal["none", "tensorstore", "restart-or-nccl"]


@dataclasses.dataclass(frozen=True)
class SamplerStart:
    """What an engine's `start` is given: the run's config; `make_samplers(cfg, **policy_args)`, the
    in-process backend's factory; the policy's arguments (`params`, `tok`, `version`, `mesh`,
    `rules`); the run's checkpoint directory, weight store URL and output directory; the echo."""

    cfg: Config
    make_samplers: Callable[..., SamplerBackend]
    policy_args: dict[str, Any]
    checkpoint_dir: str
    store_url: str
    out_dir: Path
    echo: Callable[[str], None]


Started = tuple[SamplerBackend, Placement | None]
Start = Callable[[contextlib.AsyncExitStack, SamplerStart], Awaitable[Started]]


@dataclasses.dataclass(frozen=True)
class SamplerEngine:
    """One sampler engine (module docstring)."""

    name: str
    places: Places
    weight_store: WeightStore
    pins_trainer: bool
    starts_on_checkpoint: bool
    start: Start

    @property
    def needs_store(self) -> bool:
        """Whether its samplers take new versions from the tensorstore weight store."""
        return self.weight_store == "tensorstore"

    def store_url(self, cfg: Config, out_dir: Path) -> str:
        """The store the learner publishes to: `rl.weight_store`, else `file://OUT_DIR/weight_store`
        for replicas the run starts that follow a store, else '' (none)."""
        r = cfg.rl
        if r.weight_store:
            return r.weight_store
        return f"file://{out_dir.resolve()}/weight_store" if self.needs_store and r.local_samplers else ""

    def checkpoint_first(self, cfg: Config) -> bool:
        """Whether the run starts replicas that load its step checkpoint (written before they start)."""
        return self.starts_on_checkpoint and bool(cfg.rl.local_samplers)


async def _start_in_process(stack: contextlib.AsyncExitStack, s: SamplerStart) -> Started:
    return s.make_samplers(s.cfg, **s.policy_args), None


async def _start_serve(stack: contextlib.AsyncExitStack, s: SamplerStart) -> Started:
    return start_serve(
        stack,
        s.cfg,
        s.policy_args["tok"],
        version=s.policy_args["version"],
        checkpoint_dir=s.checkpoint_dir,
        store_url=s.store_url,
        out_dir=s.out_dir,
        echo=s.echo,
    )


async def _start_vllm(stack: contextlib.AsyncExitStack, s: SamplerStart) -> Started:
    from composer_jax.rl.samplers.vllm_launch import start_vllm  # vLLM's code: only runs that use it

    return await start_vllm(stack, s.cfg, s.policy_args, s.out_dir, s.echo)


ENGINES: dict[str, SamplerEngine] = {
    e.name: e
    for e in (
        SamplerEngine(
            "in-process",
            places="nothing",
            weight_store="none",
            pins_trainer=False,
            starts_on_checkpoint=False,
            start=_start_in_process,
        ),
        SamplerEngine(
            "serve",
            places="serve replicas",
            weight_store="tensorstore",
            pins_trainer=True,
            starts_on_checkpoint=True,
            start=_start_serve,
        ),
        SamplerEngine(
            "vllm",
            places="vllm replicas",
            weight_store="restart-or-nccl",
            pins_trainer=False,
            starts_on_checkpoint=False,
            start=_start_vllm,
        ),
    )
}
IN_PROCESS = ENGINES["in-process"]
# the engines `rl.sampler_engine` names (those with replicas): config/rl.py's SAMPLER_ENGINES
REPLICA_ENGINES: tuple[str, ...] = tuple(name for name, e in ENGINES.items() if e.places != "nothing")


def engine_of(cfg: Config) -> SamplerEngine:
    """The run's engine: in-process when no replicas are named, else `rl.sampler_engine`'s."""
    r = cfg.rl
    if not (r.sampler_urls or r.local_samplers):
        return IN_PROCESS
    if r.sampler_engine not in REPLICA_ENGINES:
        raise ConfigError(
            f"rl.sampler_engine={r.sampler_engine!r} is not accepted; accepted: "
            + " or ".join(map(repr, REPLICA_ENGINES))
        )
    return ENGINES[r.sampler_engine]
