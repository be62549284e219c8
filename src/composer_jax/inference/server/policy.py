"""Policy weights for serving: a model config and its parameters from a checkpoint directory.

The three kinds of directory that `hf/checkpoint_kind.py` tells apart (as it does for
`train.init_from`, so `serve` and training accept the same directories) are read:

  run     a training checkpoint written by the pretrain/sft/rl stages (`checkpoint/manager.py`):
          the run directory holding checkpoints/, its checkpoint directory (its latest step is used,
          or `step`), one step's directory, or a gs:// URL of one. The model config is the run
          config saved with the step; only the parameters are read (not the optimiser moments).
          A `train.lora` run's checkpoint holds adapters: they are merged into the run's frozen
          base (`hf/lora_export.py`'s `load_lora_run`), which `Policy.lora` keeps, so that the
          adapters of each version the run publishes merge into it again (inference/server/app.py).
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
from composer_jax.config import ConfigError, ModelConfig, config_from_dict
from composer_jax.hf.checkpoint_kind import detect
from composer_jax.hf.convert import load_orbax
from composer_jax.hf.lora_export import LoraRun, load_lora_run, lora_run_config
from composer_jax.hf.weights import from_pretrained
from composer_jax.model.params import abstract_params
from composer_jax.sharding import ShardingRules


@dataclasses.dataclass
class Policy:
    """cfg: the model config; params: on the mesh (or the default device); kind: one of
    `checkpoint_kind.KINDS`; path: as given; step: the training step (run kind); tokenizer_hint: a
    tokenizer path, or None."""

    cfg: ModelConfig
    params: Any
    kind: str
    path: str
    step: int | None
    tokenizer_hint: str | None
    lora: LoraRun | None = None  # a train.lora run's checkpoint: its base and adapters (params: merged)


def _placed(cfg: ModelConfig, mesh: Mesh | None, rules: ShardingRules | None) -> Any:
    if mesh is not None:
        return abstract_params(cfg, mesh, rules)
    one = SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=one), abstract_params(cfg))


def _tokenizer_next_to(where: str) -> str | None:
    if "://" in where:  # an object store: no tokenizer is looked for there
        return None
    p = Path(where)
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
    key: str = "checkpoint",
) -> Policy:
    """Read a checkpoint directory of any kind (module docstring). step: for training checkpoints,
    the step to read (default the latest); key: what the user gave the path as, named by errors."""
    found = detect(path, key)
    kind, where = found.kind, found.where
    if step is not None and kind != "run":
        raise ConfigError(f"step={step} applies to training checkpoints only; {found.path!r} is a {kind} directory")
    if kind == "hf":
        cfg, params = from_pretrained(where, mesh, rules=rules)
        return Policy(cfg, params, kind, found.path, None, _tokenizer_next_to(where))
    if kind == "orbax":
        cfg, params = load_orbax(Path(where), None)
        params = jax.device_put(params, jax.tree.map(lambda s: s.sharding, _placed(cfg, mesh, rules)))
        return Policy(cfg, params, kind, found.path, None, _tokenizer_next_to(where))
    saved, step = read_run_config(where, step)
    # the model section only: the rest of a run's saved config may hold keys of an earlier release
    hint = _tokenizer_next_to(where) or (saved.get("data") or {}).get("tokenizer") or None
    if lora_run_config(saved) is not None:  # the adapters over the run's frozen base, merged to serve
        run = load_lora_run(where, step, saved, mesh=mesh, rules=rules)
        return Policy(run.cfg.model, run.merged(), kind, found.path, step, hint, lora=run)
    cfg = config_from_dict({"model": saved.get("model") or {}}, num_devices=None).model
    params = restore_params_only(where, _placed(cfg, mesh, rules), step)
    return Policy(cfg, params, kind, found.path, step, hint)
