"""Where a stage's weights and architecture come from: `train.init_from` and `model.from`.

Reads the three kinds of checkpoint directory that `hf/checkpoint_kind.py` tells apart (the module
that decides the kind for `serve` too):

    run     a training run's checkpoints: parameters of its train state, its saved run config
    hf      a Hugging Face checkpoint (config.json + model.safetensors or an index and its shards)
    orbax   what `composer-jax convert --to-orbax` writes (params/ + model.yaml)

`load_init_params` reads the parameters straight onto the run's shardings, after checking the run's
`model` section against the checkpoint's config (a mismatch names the key and both values), and
returns the `init` record the run logs (kind, path, family, the config file's sha256).
`resolve_model_from` fills the model section from a checkpoint's config (`model.from: "hf:DIR"`).

Memory: an HF checkpoint is memory-mapped and read one device block at a time (`hf/weights.py`,
`read_params`); orbax restores into the target shardings. Either way each process reads only the
blocks its own devices hold (`addressable_devices_indices_map`; orbax likewise), so no host
holds the whole model.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import jax
import yaml

from composer_jax.checkpoint.manager import read_run_config, restore_params_only
from composer_jax.checkpoint.validate import config_differences
from composer_jax.config import Config, ConfigError, ModelConfig, check_sections, config_from_dict, to_dict
from composer_jax.config.model import (
    BENEATH,
    BESIDE,
    IMPLEMENTATION_KEYS,
    OVERRIDE,
    SHAPE_KEYS,
    STAGE_CHANGEABLE,
    model_from,
)
from composer_jax.config.run import validate_sections
from composer_jax.hf.checkpoint_kind import detect
from composer_jax.hf.config import family_for
from composer_jax.hf.weights import read_model_config, read_params
from composer_jax.model.params import abstract_params

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Source:
    """A checkpoint directory of one of the three kinds. config_file: the file its architecture is
    read from (for a run: its latest committed step's directory); config_sha256: of that file's
    bytes (for a run: of the saved run config as sorted JSON)."""

    kind: str
    path: str  # as given
    where: str  # the directory read (a run directory's checkpoints/)
    config_file: str
    config_sha256: str
    step: int | None = None

    def record(self, family: str | None) -> dict[str, Any]:
        """The run's `init` record (metrics.jsonl and the summary)."""
        out = {"kind": self.kind, "path": self.path, "family": family, "config": self.config_file}
        out["config_sha256"] = self.config_sha256
        return out if self.step is None else {**out, "step": self.step}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def open_source(path: str, key: str = "train.init_from") -> tuple[Source, ModelConfig]:
    """The checkpoint at `path` (`checkpoint_kind.detect`) and the ModelConfig it was saved with."""
    found = detect(path, key)
    kind, where = found.kind, found.where
    if kind == "hf":
        cfg, _info = read_model_config(where)
        f = Path(where) / "config.json"
        return Source(kind, path, where, str(f), _sha(f.read_bytes())), cfg
    if kind == "orbax":
        f = Path(where) / "model.yaml"
        section = (yaml.safe_load(f.read_text()) or {}).get("model") or {}
        model = config_from_dict({"model": section}, num_devices=None).model
        return Source(kind, path, where, str(f), _sha(f.read_bytes())), model
    saved, step = read_run_config(where)
    model = config_from_dict({"model": saved.get("model") or {}}, num_devices=None).model
    text = json.dumps(saved, sort_keys=True).encode()
    return Source(kind, path, where, os.path.join(where, str(step)), _sha(text), step), model


def _family(model: ModelConfig) -> str | None:
    try:
        return family_for(model)
    except ConfigError:
        return None  # e.g. a dense model: no Hugging Face family computes it


def _not_shape_keys() -> tuple[str, ...]:
    return tuple(f"model.{f.name}" for f in dataclasses.fields(ModelConfig) if f.name not in SHAPE_KEYS)


def check_model(run: ModelConfig, saved: ModelConfig, source: Source, allowed: Sequence[str]) -> None:
    """ConfigError listing each model key (outside `allowed`) where the run differs from the
    checkpoint: "model.num_layers=4 but checkpoint DIR/config.json says 2"."""
    diffs = config_differences({"model": to_dict(saved)}, {"model": to_dict(run)}, ("model",), allowed)
    if not diffs:
        return
    listed = "; ".join(f"{k}={now!r} but checkpoint {source.config_file} says {was!r}" for k, was, now in diffs)
    if run.from_:  # a command-line override of a shape field, or init_from another architecture than `from`
        raise ConfigError(
            f"{listed}: a field that sets a parameter shape must equal the checkpoint's for its weights to load"
        )
    raise ConfigError(
        f"{listed}. Give the checkpoint's values, or take the model from it: model.from={source.kind}:{source.path}"
    )


def load_init_params(cfg: Config, mesh, rules, run_config: dict, *, target: Any = None) -> tuple[dict, dict[str, Any]]:
    """(parameters of `train.init_from` on the run's shardings, the run's `init` record).

    The run's model section must match the checkpoint's config outside the keys a stage may change
    (`STAGE_CHANGEABLE` for a run; also the implementation keys for hf/orbax; with `model.from`,
    every key that sets no parameter shape). Parameters are cast to model.param_dtype. `target`:
    the abstract parameters (ShapeDtypeStructs with shardings) to read into instead of the run's
    (`abstract_params(cfg.model, mesh, rules)`), e.g. one device's for an export."""
    source, saved = open_source(cfg.train.init_from)
    free = _not_shape_keys() if cfg.model.from_ else ()
    if target is None:
        target = abstract_params(cfg.model, mesh, rules)
    if source.kind == "run":
        allowed = tuple(STAGE_CHANGEABLE) + free
        params = restore_params_only(source.where, target, config=run_config, allow_config_changes=allowed)
    else:
        check_model(cfg.model, saved, source, tuple(IMPLEMENTATION_KEYS) + free)
        params = _read(source, cfg.model, target)
    return params, source.record(_family(saved))


def _read(source: Source, model: ModelConfig, target: Any) -> dict:
    if source.kind == "hf":
        _saved, info = read_model_config(source.where)
        return read_params(source.where, model, info, jax.tree.map(lambda s: s.sharding, target))
    import orbax.checkpoint as ocp

    # restoring into ShapeDtypeStructs with shardings: each process reads its own blocks, cast to
    # the target dtype
    return ocp.StandardCheckpointer().restore(Path(source.where).resolve() / "params", target)


def describe_init(record: dict[str, Any]) -> str:
    """An `init` record as the console's phrase: "hf checkpoint DIR (deepseek_v3, config sha256 1a2b...)"."""
    notes = [record["family"]] if record.get("family") else []
    if "config_sha256" in record:
        notes.append(f"config sha256 {record['config_sha256'][:12]}")
    return f"{record['kind']} checkpoint {record['path']}" + (f" ({', '.join(notes)})" if notes else "")


def fresh_record(cfg: Config) -> dict[str, Any]:
    """The `init` record of a run that starts from a fresh initialisation."""
    return {"kind": "scratch", "seed": cfg.train.seed, "family": _family(cfg.model)}


# With `model.from`, the fields a checkpoint does not decide (how the run computes: kernels, dtypes,
# remat, the name) come from the config wherever they are written, and so do the context keys a
# stage sets for itself (YaRN extension); every other field is the checkpoint's architecture.
CONTEXT_KEYS: tuple[str, ...] = ("rope_scaling", "max_position_embeddings")


def _run_settings() -> set[str]:
    return {k.removeprefix("model.") for k in IMPLEMENTATION_KEYS} - {"from", *CONTEXT_KEYS}


def resolve_model_from(cfg: Config, num_devices: int | None | Literal["auto"] = "auto") -> Config:
    """`cfg` with its model section filled from `model.from`'s checkpoint config (unchanged when
    empty or already resolved). The checkpoint's config is the model (docs/models.md, "Taking the
    model from a checkpoint"); by where a field was written (`cfg.model_origin`):

      a run setting the checkpoint does not decide, or a context key: the config's value
      in a file beneath the one giving `from`: replaced by the checkpoint's value (logged at info)
      in the file giving `from`, or a later one: must equal the checkpoint's, else a ConfigError
          naming each such field, its value, the file and the checkpoint's value
      on the command line: a deliberate override, used and logged (a warning naming the field,
          the checkpoint's value and the new one), as is a context key that differs

    Revalidated against the mesh (num_devices as for `config_from_dict`: "auto" =
    jax.device_count(), None = no device check)."""
    spec = model_from(cfg.model)
    origin = cfg.model_origin
    if spec is None or origin.resolved_from == cfg.model.from_:
        return cfg
    kind, path = spec
    source, saved = open_source(path, key="model.from")
    if source.kind != kind:
        raise ConfigError(f"model.from={cfg.model.from_!r}: {path!r} is a {source.kind} checkpoint, not {kind}")
    default, settings = ModelConfig(), _run_settings()
    kept: dict[str, Any] = {}
    replaced: list[str] = []
    clash: list[str] = []
    for f in dataclasses.fields(ModelConfig):
        mine, theirs = getattr(cfg.model, f.name), getattr(saved, f.name)
        if f.name == "from_":
            continue
        if origin.known:
            written = origin.role(f.name)
        else:  # a config the loader did not build: what differs from the default was written beside `from`
            written = (BESIDE, "the model section") if mine != getattr(default, f.name) else None
        if written is None:
            continue
        role, where = written
        if f.name in settings or f.name in CONTEXT_KEYS or role == OVERRIDE:
            kept[f.name] = mine
            if mine != theirs and f.name not in settings:
                log.warning(
                    "model.from: model.%s=%s (%s) replaces the checkpoint's %s (%s)",
                    f.name,
                    _value(mine),
                    where,
                    _value(theirs),
                    source.config_file,
                )
        elif mine == theirs:
            continue
        elif role == BENEATH:
            replaced.append(f"{f.name} {_value(mine)} -> {_value(theirs)} ({where})")
        else:
            clash.append(
                f"model.{f.name}={_value(mine)} (written in {where}) but checkpoint {source.config_file} says "
                f"{_value(theirs)}"
            )
    if clash:
        raise ConfigError(
            f"{'; '.join(clash)}: with model.from={cfg.model.from_} the checkpoint's config is the model; remove "
            "these keys from that file (or give the checkpoint's values), or override the checkpoint deliberately "
            "on the command line (model.KEY=VALUE)"
        )
    if replaced:
        log.info("model.from: %s replaces %s", source.config_file, ", ".join(replaced))
    model = dataclasses.replace(saved, **kept, from_=cfg.model.from_)
    out = dataclasses.replace(cfg, model=model, model_origin=dataclasses.replace(origin, resolved_from=cfg.model.from_))
    validate_sections(out)
    check_sections(out, jax.device_count() if num_devices == "auto" else num_devices)
    return out


def _value(v: Any) -> str:
    """A model field's value as a message shows it (a nested section as its YAML mapping)."""
    return repr(to_dict(v) if dataclasses.is_dataclass(v) else v)
