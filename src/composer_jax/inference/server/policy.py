"""Policy weights for serving: a model config and its parameters from a checkpoint directory.

Three kinds of directory are read (`checkpoint_kind` tells them apart):

  train   a training checkpoint written by the pretrain/sft stages (`checkpoint/manager.py`): the
          run's root (its latest step is used, or `step`) or one step's directory. The model
          config is the run config saved with the step; only the parameters are read (not the
          optimiser moments).
  orbax   a directory written by `composer-jax convert --to-orbax` (params/ + model.yaml).
  hf      a Hugging Face directory (config.json + *.safetensors), read by `hf/weights.py`.

`tokenizer_hint` is where the checkpoint says its tokenizer is: the directory itself (or its run
root) when it holds a tokenizer.json, else the training run's `data.tokenizer`.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import jax
from jax.sharding import Mesh, SingleDeviceSharding

from composer_jax.checkpoint.manager import read_run_config, restore_params_only
from composer_jax.config import ConfigError, ModelConfig, config_from_dict, to_dict
from composer_jax.hf.convert import load_orbax
from composer_jax.hf.weights import from_pretrained
from composer_jax.model.params import abstract_params
from composer_jax.sharding import ShardingRules

KINDS = ("train", "orbax", "hf")


@dataclasses.dataclass
class Policy:
    """cfg: the model config; params: on the mesh (or the default device); kind: one of KINDS;
    step: the training step (train kind); tokenizer_hint: a tokenizer path, or None."""

    cfg: ModelConfig
    params: Any
    kind: str
    path: str
    step: int | None
    tokenizer_hint: str | None


def checkpoint_kind(path: str | os.PathLike) -> str:
    """Which of KINDS `path` is; raises ConfigError naming what each kind holds."""
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"checkpoint {str(path)!r} is not a directory")
    if (p / "config.json").is_file():
        return "hf"
    if (p / "model.yaml").is_file() and (p / "params").is_dir():
        return "orbax"
    steps = [c for c in p.iterdir() if c.is_dir() and c.name.isdigit()]
    if (p / "train_state").is_dir() or steps:
        return "train"
    raise ConfigError(
        f"checkpoint {str(path)!r}: not a checkpoint directory; accepted: a training run's checkpoint "
        "directory (numbered step directories) or one step's directory, a `convert --to-orbax` directory "
        "(params/ + model.yaml), or a Hugging Face directory (config.json + *.safetensors)"
    )


def _placed(cfg: ModelConfig, mesh: Mesh | None, rules: ShardingRules | None) -> Any:
    if mesh is not None:
        return abstract_params(cfg, mesh, rules)
    one = SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one), abstract_params(cfg))


def _tokenizer_next_to(p: Path) -> str | None:
    for d in (p, p.parent):
        if (d / "tokenizer.json").is_file():
            return str(d)
    return None


def load_policy(
    path: str | os.PathLike,
    *,
    step: int | None = None,
    mesh: Mesh | None = None,
    rules: ShardingRules | None = None,
) -> Policy:
    """Read a checkpoint directory of any of KINDS (module docstring). step: for training
    checkpoints, the step to read (default the latest)."""
    kind = checkpoint_kind(path)
    p = Path(path)
    if step is not None and kind != "train":
        raise ConfigError(f"step={step} applies to training checkpoints only; {str(path)!r} is a {kind} directory")
    if kind == "hf":
        cfg, params = from_pretrained(p, mesh, rules=rules)
        return Policy(cfg, params, kind, str(p), None, _tokenizer_next_to(p))
    if kind == "orbax":
        cfg, params = load_orbax(p, None)
        params = jax.device_put(params, jax.tree.map(lambda s: s.sharding, _placed(cfg, mesh, rules)))
        return Policy(cfg, params, kind, str(p), None, _tokenizer_next_to(p))
    saved, step = read_run_config(p, step)
    # the model section only: the rest of a run's saved config may hold keys of an earlier release
    cfg = config_from_dict({"model": saved.get("model") or {}}, num_devices=None).model
    params = restore_params_only(p, _placed(cfg, mesh, rules), step)
    hint = _tokenizer_next_to(p) or (saved.get("data") or {}).get("tokenizer") or None
    return Policy(cfg, params, kind, str(p), step, hint)


def config_differences(a: ModelConfig, b: ModelConfig) -> list[str]:
    """`key: a -> b` for every model-config field that differs, except `name`."""
    da, db = to_dict(a), to_dict(b)
    return [f"model.{k}: {da[k]!r} -> {db.get(k)!r}" for k in da if k != "name" and da[k] != db.get(k)]
