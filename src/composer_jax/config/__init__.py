"""Configuration: frozen dataclasses loaded from YAML with `key=value` overrides, validated at load.

Validation: each section's own fields by its module's `validate_<section>` function, every check
across sections in `run.py` (`check_sections` at load, `check_rl_run` for the RL learner).

Every error a user can cause names the key, the value given and what is accepted.

The package is the ground floor: it imports no subsystem. `loader` is the generic machinery
(YAML with `base:` includes, overrides, typed dataclass construction); each section is a module of
its own (`model`, `mesh`, `train`, `data`, `checkpoint`, `rl`, `sampler`, `agent`; later `inference`, `quant`), and
`run` composes them into the run's `Config`. Subsystems import their section from here.
"""

from __future__ import annotations

from composer_jax.config.agent import AgentConfig, validate_agent
from composer_jax.config.checkpoint import CheckpointConfig, validate_checkpoint_config
from composer_jax.config.data import DataConfig, DataConfigError, SourceConfig, validate_data_config
from composer_jax.config.loader import (
    build_dataclass,
    coerce,
    deep_merge,
    parse_overrides,
    read_yaml,
    read_yaml_layers,
    set_path,
    to_dict,
)
from composer_jax.config.lora import LoraConfig, lora_targets, validate_lora
from composer_jax.config.mesh import MESH_AXES, MeshConfig, validate_mesh
from composer_jax.config.model import ModelConfig, RopeScalingConfig, validate_model
from composer_jax.config.rl import JudgeConfig, LengthPenaltyConfig, RewardConfig, RLConfig, RLLossConfig, validate_rl
from composer_jax.config.run import (
    Config,
    check_rl_run,
    check_sections,
    config_from_dict,
    config_from_layers,
    load_config,
    validate_mesh_for_model,
    validate_sections,
)
from composer_jax.config.sampler import PREFIX_CACHE_MODES, SamplerConfig, validate_sampler
from composer_jax.config.train import OptimizerConfig, TrainConfig, validate_train
from composer_jax.errors import ConfigError

__all__ = [
    "AgentConfig",
    "MESH_AXES",
    "CheckpointConfig",
    "Config",
    "ConfigError",
    "DataConfig",
    "DataConfigError",
    "MeshConfig",
    "JudgeConfig",
    "LengthPenaltyConfig",
    "LoraConfig",
    "ModelConfig",
    "OptimizerConfig",
    "RLConfig",
    "RLLossConfig",
    "RewardConfig",
    "RopeScalingConfig",
    "PREFIX_CACHE_MODES",
    "SamplerConfig",
    "SourceConfig",
    "TrainConfig",
    "build_dataclass",
    "check_rl_run",
    "check_sections",
    "coerce",
    "config_from_dict",
    "config_from_layers",
    "deep_merge",
    "load_config",
    "lora_targets",
    "parse_overrides",
    "read_yaml",
    "read_yaml_layers",
    "set_path",
    "to_dict",
    "validate_agent",
    "validate_checkpoint_config",
    "validate_data_config",
    "validate_lora",
    "validate_mesh",
    "validate_mesh_for_model",
    "validate_model",
    "validate_rl",
    "validate_sampler",
    "validate_sections",
    "validate_train",
]
