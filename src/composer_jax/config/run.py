"""A run's whole configuration: the sections composed into `Config`, loaded and validated together.

Validation has one shape (docs/architecture.md, "Config validation"): each section module has a
`validate_<section>` function checking that section's own fields, which `config_from_dict` runs for
every section at load; every check that reads more than one section is here (`check_sections`,
run at load; `check_rl_run`, run by the RL learner, which knows its process count and cores).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from composer_jax.config.agent import AgentConfig, validate_agent
from composer_jax.config.checkpoint import CheckpointConfig, validate_checkpoint_config
from composer_jax.config.data import DataConfig, validate_data_config
from composer_jax.config.loader import (
    build_dataclass,
    deep_merge,
    parse_overrides,
    plain,
    read_yaml_layers,
    set_path,
)
from composer_jax.config.lora import lora_targets
from composer_jax.config.mesh import MESH_AXES, MeshConfig, validate_mesh
from composer_jax.config.model import (
    BENEATH,
    BESIDE,
    COMMAND_LINE,
    OVERRIDE,
    ModelConfig,
    ModelOrigin,
    validate_model,
)
from composer_jax.config.rl import RLConfig, validate_rl
from composer_jax.config.train import TrainConfig, validate_train
from composer_jax.errors import ConfigError


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
    # where the model section's fields were written (`model_origin`), for `model.from`; no YAML key
    model_origin: ModelOrigin = dataclasses.field(
        default_factory=ModelOrigin, compare=False, repr=False, metadata={"yaml": False}
    )


# one layer of a config: where it was written (a file, or a name such as "the config mapping") and
# what it holds; later layers are merged over earlier ones, and the command line over them all
Layer = tuple[str | Path, Mapping[str, Any]]


def config_from_dict(
    data: Mapping[str, Any], overrides: Sequence[str] = (), *, num_devices: int | None | Literal["auto"] = "auto"
) -> Config:
    """Build and validate a `Config` from a nested mapping plus `key=value` overrides.

    num_devices: "auto" checks the mesh against `jax.device_count()`; None skips the device check
    (e.g. `inspect` on a hypothetical cluster mesh).
    """
    return config_from_layers([("the config mapping", data)], overrides, num_devices=num_devices)


def config_from_layers(
    layers: Sequence[Layer], overrides: Sequence[str] = (), *, num_devices: int | None | Literal["auto"] = "auto"
) -> Config:
    """`config_from_dict` of the layers merged in order, recording where each model field was
    written (`Config.model_origin`, for `model.from`)."""
    tree: dict = {}
    for _where, data in layers:
        deep_merge(tree, plain(data))  # plain: a copy, so merging never changes a layer
    parsed = parse_overrides(overrides)
    for path, value in parsed:
        set_path(tree, path, value)
    cfg = build_dataclass(Config, tree, "")
    cfg = dataclasses.replace(cfg, model_origin=model_origin(layers, parsed))
    validate_sections(cfg)
    if num_devices == "auto":
        import jax  # local: the environment server imports this module's siblings without JAX

        num_devices = jax.device_count()
    check_sections(cfg, num_devices)
    return cfg


def model_origin(layers: Sequence[Layer], overrides: Sequence[tuple[Sequence[str], Any]]) -> ModelOrigin:
    """Where each model field was last written (a layer's file, or the command line) and its role
    relative to the layer that gives `model.from` (`ModelOrigin`). A field counts as written when
    any key of it is (`model.rope_scaling.factor` writes rope_scaling)."""
    field_of = {ModelConfig.YAML_KEYS.get(f.name, f.name): f.name for f in dataclasses.fields(ModelConfig)}
    last: dict[str, int] = {}  # field -> index of the last layer writing it (len(layers): the command line)
    for i, (_where, data) in enumerate(layers):
        section = plain(data).get("model")
        for key in section if isinstance(section, Mapping) else ():
            if key in field_of:
                last[field_of[key]] = i
    for path, value in overrides:
        if path[0] != "model":
            continue
        keys = [path[1]] if len(path) > 1 else list(value) if isinstance(value, Mapping) else []
        last.update({field_of[k]: len(layers) for k in keys if k in field_of})
    at = last.pop("from_", None)
    written = []
    for name, i in last.items():
        where = COMMAND_LINE if i == len(layers) else _shown(layers[i][0])
        role = OVERRIDE if i == len(layers) else BENEATH if at is None or i < at else BESIDE
        written.append((name, role, where))
    return ModelOrigin(known=True, written=tuple(written))


def _shown(where: str | Path) -> str:
    """A layer's file as the user gave it: relative to the current directory when inside it."""
    p = Path(where)
    if p.is_absolute():
        try:
            return str(p.relative_to(Path.cwd()))
        except ValueError:
            return str(p)
    return str(where)


def validate_sections(cfg: Config) -> None:
    """Every section's own checks (a section's `validate_<section>`); `data` without requiring
    sources: only what reads documents needs them (`data/pipeline.py` checks that where it reads)."""
    validate_model(cfg.model)
    validate_mesh(cfg.mesh)
    validate_train(cfg.train)
    validate_data_config(cfg.data, require_sources=False)
    validate_checkpoint_config(cfg.checkpoint)
    validate_rl(cfg.rl)
    validate_agent(cfg.agent)


def check_sections(cfg: Config, num_devices: int | None) -> None:
    """The checks across sections that every run needs: the mesh against the devices and the model
    (`validate_mesh_for_model`), the sequence against the context axis. num_devices None: the
    mesh is not resolved (e.g. `inspect` on a hypothetical cluster mesh)."""
    validate_mesh_for_model(cfg.mesh, cfg.model, num_devices)
    t = cfg.train
    if t.lora.enabled:
        lora_targets(t.lora, cfg.model)  # the targets against the model's projections
    if num_devices is not None:
        sizes = cfg.mesh.shape(num_devices)
        if t.seq_len % (2 * sizes["context"]) and sizes["context"] > 1:
            raise ConfigError(
                f"train.seq_len={t.seq_len} must be divisible by 2 x mesh.context="
                f"{2 * sizes['context']} (zigzag context-parallel layout)"
            )


def validate_mesh_for_model(mesh: MeshConfig, m: ModelConfig, num_devices: int | None) -> None:
    """Impossible model/mesh combinations: heads over tensor, experts over expert, devices."""
    validate_mesh(mesh)
    sizes = mesh.shape(num_devices) if num_devices is not None else {a: getattr(mesh, a) for a in MESH_AXES}
    tp, ep = sizes["tensor"], sizes["expert"]
    if tp > 0 and m.num_heads % tp:
        raise ConfigError(
            f"model.num_heads={m.num_heads} is not divisible by mesh.tensor={tp}; "
            f"accepted tensor sizes: {[d for d in range(1, m.num_heads + 1) if m.num_heads % d == 0]}"
        )
    if m.attention_type == "gqa" and tp > 0 and m.num_kv_heads % tp:
        raise ConfigError(f"model.num_kv_heads={m.num_kv_heads} is not divisible by mesh.tensor={tp}")
    if m.num_experts and ep > 0 and m.num_experts % ep:
        raise ConfigError(
            f"model.num_experts={m.num_experts} is not divisible by mesh.expert={ep}; "
            f"accepted expert sizes: {[d for d in range(1, m.num_experts + 1) if m.num_experts % d == 0]}"
        )
    if not m.num_experts and ep > 1:
        raise ConfigError(f"mesh.expert={ep} but the model is dense (model.num_experts=0); set mesh.expert=1")


def check_rl_run(cfg: Config, *, process_count: int, cores: Collection[int]) -> None:
    """The RL learner's checks across `rl`, `train` and `agent`, and against the job it runs in:
    `process_count` (`jax.process_count()`) and `cores`, the cores this process may use
    (`os.sched_getaffinity(0)`; read only with rl.pin_cores). ConfigError naming the keys."""
    r, t, a = cfg.rl, cfg.train, cfg.agent
    if t.lora.enabled and (r.sampler_urls or r.local_samplers) and r.sampler_engine != "serve":
        raise ConfigError(
            f"train.lora.rank={t.lora.rank} with rl.sampler_engine={r.sampler_engine!r} replicas: a publish "
            "holds the adapters only, which only `composer-jax serve` replicas merge into their base; "
            "accepted: rl.sampler_engine=serve, the in-process sampler (neither rl.sampler_urls nor "
            "rl.local_samplers set), or train.lora.rank=0"
        )
    if not r.tasks:
        raise ConfigError("rl.tasks is empty; give the task ids (or gen/FAMILY) to train on")
    if r.group_size < 2:
        raise ConfigError(f"rl.group_size={r.group_size}: a group needs at least 2 rollouts for an advantage")
    if t.batch_size < r.group_size:
        raise ConfigError(
            f"train.batch_size={t.batch_size} rows cannot hold one group of rl.group_size={r.group_size} rollouts"
        )
    if a.max_turn_tokens >= t.seq_len:
        raise ConfigError(
            f"agent.max_turn_tokens={a.max_turn_tokens} must be below train.seq_len={t.seq_len}, the longest "
            "generation a batch row (and the sampler) holds"
        )
    if t.micro_batches > 1 and t.batch_size % t.micro_batches:
        raise ConfigError(f"train.batch_size={t.batch_size} must be divisible by train.micro_batches={t.micro_batches}")
    if process_count > 1:
        if not (r.sampler_urls or r.local_samplers):
            raise ConfigError(
                f"a trainer of {process_count} processes samples through `composer-jax serve` replicas: give "
                "rl.sampler_urls (replica URLs) or rl.local_samplers >= 1 (started by process 0); the in-process "
                "sampler (rl.local_samplers=0, no rl.sampler_urls) runs inside a one-process trainer only"
            )
        if r.pin_cores:
            raise ConfigError(
                f"rl.pin_cores=true pins a one-process trainer and its replicas on one machine; this trainer has "
                f"{process_count} processes: accepted rl.pin_cores=false"
            )
    if r.pin_cores:
        if not r.local_samplers:
            raise ConfigError(
                "rl.pin_cores pins the trainer and the rl.local_samplers replicas to cores of their own; "
                "with rl.local_samplers=0 there is nothing to pin apart"
            )
        usable = sorted(cores)
        need = int(r.pin_trainer) + r.local_samplers
        if len(usable) < need:
            whose = "one for the trainer, one per replica" if r.pin_trainer else "one per replica; rl.pin_trainer=false"
            raise ConfigError(
                f"rl.pin_cores with rl.local_samplers={r.local_samplers} needs {need} cores ({whose}); "
                f"this process may use {len(usable)}: {usable}"
            )
    if r.queue_size and r.queue_size < r.groups_per_step:
        raise ConfigError(
            f"rl.queue_size={r.queue_size} cannot hold one step's rl.groups_per_step={r.groups_per_step} groups; "
            "give at least that, or 0 (bounded by the staleness only)"
        )


def load_config(
    path: str | Path | None = None, overrides: Sequence[str] = (), *, num_devices: int | None | Literal["auto"] = "auto"
) -> Config:
    """Load `path` (YAML; may name a `base:` file to extend) and apply `key=value` overrides."""
    layers: list[Layer] = list(read_yaml_layers(Path(path).resolve())) if path is not None else []
    return config_from_layers(layers, overrides, num_devices=num_devices)
