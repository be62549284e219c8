"""A run's whole configuration: the sections composed into `Config`, loaded and validated together."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from composer_jax.config.agent import AgentConfig
from composer_jax.config.checkpoint import CheckpointConfig
from composer_jax.config.data import DataConfig
from composer_jax.config.loader import build_dataclass, parse_overrides, plain, read_yaml, set_path
from composer_jax.config.mesh import MeshConfig, validate_mesh_for_model
from composer_jax.config.model import ModelConfig, validate_model
from composer_jax.config.rl import RLConfig
from composer_jax.config.train import TrainConfig, validate_train


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    rl: RLConfig = dataclasses.field(default_factory=RLConfig)  # used by `composer-jax rl` only
    agent: AgentConfig = dataclasses.field(default_factory=AgentConfig)  # rollouts: `rl`, `eval`
    # logical axis -> mesh axes overrides of the default rules in sharding.py
    sharding_rules: Mapping[str, Any] = dataclasses.field(default_factory=dict)


def config_from_dict(
    data: Mapping[str, Any], overrides: Sequence[str] = (), *, num_devices: int | None | Literal["auto"] = "auto"
) -> Config:
    """Build and validate a `Config` from a nested mapping plus `key=value` overrides.

    num_devices: "auto" checks the mesh against `jax.device_count()`; None skips the device check
    (e.g. `inspect` on a hypothetical cluster mesh).
    """
    tree = plain(data)
    for path, value in parse_overrides(overrides):
        set_path(tree, path, value)
    cfg = build_dataclass(Config, tree, "")
    validate_model(cfg.model)
    if num_devices == "auto":
        import jax  # local: the environment server imports this module's siblings without JAX

        num_devices = jax.device_count()
    validate_mesh_for_model(cfg.mesh, cfg.model, num_devices)
    validate_train(cfg.train, cfg.mesh, num_devices)
    return cfg


def load_config(
    path: str | Path | None = None, overrides: Sequence[str] = (), *, num_devices: int | None | Literal["auto"] = "auto"
) -> Config:
    """Load `path` (YAML; may name a `base:` file to extend) and apply `key=value` overrides."""
    data = read_yaml(Path(path).resolve()) if path is not None else {}
    return config_from_dict(data, overrides, num_devices=num_devices)
