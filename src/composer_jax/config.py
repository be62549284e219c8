"""Configuration: frozen dataclasses loaded from YAML with `key=value` overrides, validated at load.

Every error a user can cause names the key, the value given and what is accepted. Later subsystems
(train, data, rl) add their own sections as further dataclasses on `Config`.
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import types
import typing
from pathlib import Path
from typing import Any, Literal, Mapping, Sequence

import yaml


from composer_jax.errors import ConfigError  # noqa: E402  (re-exported: composer_jax.config.ConfigError)

# Sections owned by subsystems.
from composer_jax.checkpoint.config import CheckpointConfig  # noqa: E402
from composer_jax.data.config import DataConfig  # noqa: E402


# --------------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RopeScalingConfig:
    """YaRN context extension (DeepSeek-V3 / Kimi K2 `rope_scaling` with type yarn)."""

    type: Literal["none", "yarn"] = "none"
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # DeepSeek's two magnitude corrections: cos/sin are scaled by mscale(f, mscale)/mscale(f, all_dim)
    # and the softmax scale by mscale(f, mscale_all_dim)^2 (0 disables the latter).
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A DeepSeek-V3 / Kimi-K2 / DeepSeek-V2 / Qwen3-MoE style decoder-only MoE transformer."""

    name: str = "tiny"
    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    # attention: "mla" (DeepSeek/Kimi multi-head latent attention) or "gqa" (Qwen3-MoE, q/k RMSNorm)
    attention_type: Literal["mla", "gqa"] = "mla"
    q_lora_rank: int = 0  # 0 = no query compression (DeepSeek-V2-Lite, Moonlight)
    kv_lora_rank: int = 32
    qk_nope_head_dim: int = 16
    qk_rope_head_dim: int = 8
    v_head_dim: int = 16
    rope_interleave: bool = True  # DeepSeek checkpoints rotate adjacent pairs (x0,x1),(x2,x3)...
    num_kv_heads: int = 4  # gqa only
    head_dim: int = 16  # gqa only
    qk_norm: bool = True  # gqa only (Qwen3)
    # feed-forward
    intermediate_size: int = 128  # dense layers
    moe_intermediate_size: int = 32
    num_experts: int = 8  # routed experts; 0 = dense model
    num_experts_per_tok: int = 2
    num_shared_experts: int = 1
    first_k_dense: int = 1
    score_func: Literal["sigmoid", "softmax"] = "sigmoid"
    # greedy: plain top-k; group_limited: DeepSeek-V2 (group score = max); noaux_tc: DeepSeek-V3
    # (group score = sum of top-2 of bias-corrected scores, bias used for selection only)
    topk_method: Literal["greedy", "group_limited", "noaux_tc"] = "noaux_tc"
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    router_bias_update_rate: float = 1e-3  # aux-loss-free balancing step size u
    # positions
    max_position_embeddings: int = 4096
    rope_theta: float = 10000.0
    rope_scaling: RopeScalingConfig = dataclasses.field(default_factory=RopeScalingConfig)
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = False
    num_mtp_layers: int = 0  # DeepSeek-V3 multi-token-prediction depth
    initializer_range: float = 0.02
    # numerics and implementation
    param_dtype: Literal["float32", "bfloat16"] = "float32"
    compute_dtype: Literal["float32", "bfloat16"] = "float32"
    # MoE matmul: "auto" = ragged_dot on GPU, tiled grouped matmul on CPU (ragged_dot does G x the
    # FLOPs on XLA:CPU); "dense" computes every expert for every token (reference, tiny models only)
    moe_impl: Literal["auto", "tiled", "ragged", "dense"] = "auto"
    moe_tile_size: int = 128
    # attention: "blockwise" = flash-style blocks with an online softmax and its own VJP (no
    # [q, k] score matrix; causal block skipping in the contiguous layout); "dense" = the whole
    # masked score matrix (reference). Query block size and the key chunk of the online softmax:
    attention_impl: Literal["blockwise", "dense"] = "blockwise"
    attn_block_q: int = 128
    attn_block_k: int = 1024
    remat: Literal["none", "full", "dots"] = "none"
    # True: layers run as one lax.scan body (compile time independent of depth: large models);
    # False: the scan is unrolled, which lets XLA fuse across layers and avoids the loop's
    # per-layer slicing of stacked weights and gradients (about 20% faster on XLA:CPU, small models)
    scan_layers: bool = True

    # derived -------------------------------------------------------------------------------------
    @property
    def qk_head_dim(self) -> int:
        if self.attention_type == "gqa":
            return self.head_dim
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers if self.num_experts == 0 else min(self.first_k_dense, self.num_layers)

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers

    @property
    def shared_intermediate_size(self) -> int:
        return self.moe_intermediate_size * self.num_shared_experts


MESH_AXES = ("data", "fsdp", "expert", "context", "tensor")


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """Device mesh sizes. One axis may be -1: it takes all devices the others leave."""

    data: int = 1
    fsdp: int = -1
    expert: int = 1
    context: int = 1
    tensor: int = 1

    def shape(self, num_devices: int) -> dict[str, int]:
        sizes = {a: getattr(self, a) for a in MESH_AXES}
        free = [a for a, s in sizes.items() if s == -1]
        fixed = math.prod(s for s in sizes.values() if s != -1)
        if len(free) > 1:
            raise ConfigError(f"mesh: at most one axis may be -1, got -1 for {free}")
        if free:
            if num_devices % fixed:
                raise ConfigError(
                    f"mesh.{free[0]}=-1: the other axes multiply to {fixed}, which does not divide "
                    f"the {num_devices} devices; choose sizes whose product divides {num_devices}")
            sizes[free[0]] = num_devices // fixed
        elif fixed != num_devices:
            raise ConfigError(
                f"mesh: data*fsdp*expert*context*tensor = {fixed} ({sizes}) but there are "
                f"{num_devices} devices; the product must equal the device count (or set one axis to -1)")
        return sizes


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW (optax) with a learning-rate schedule and global-norm clipping."""

    lr: float = 3e-4
    # warmup_cosine: linear warmup then cosine to min_lr_ratio * lr at train.steps;
    # wsd: warmup-stable-decay (MiniCPM): warmup, constant, then a linear decay over decay_steps
    schedule: Literal["warmup_cosine", "wsd", "constant"] = "warmup_cosine"
    warmup_steps: int = 100
    decay_steps: int = 0  # wsd only: length of the final decay (0 = 10% of train.steps)
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # not applied to norms, biases, router bias, or embeddings
    clip_norm: float = 1.0  # 0 disables clipping


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training stage (continued pretraining or SFT)."""

    stage: str = "stage1"
    seq_len: int = 128
    batch_size: int = 8  # global sequences per optimiser step
    micro_batches: int = 1  # gradient accumulation: batch_size is split into this many
    steps: int = 100
    seed: int = 0
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    z_loss: float = 1e-4  # weight of log(Z)^2 (PaLM) keeping the softmax normaliser near 1
    mtp_weight: float = 0.3
    # ce: MTP depth k trained on the token k+1 ahead; self_distill: KL from the main model's
    # (stopped) next-token distribution at that position, as Composer 2 trains its MTP layers
    mtp_loss: Literal["ce", "self_distill"] = "ce"
    seq_balance_loss: float = 0.0  # DeepSeek-V3 complementary sequence-wise balance loss weight
    router_bias_update: bool = True  # aux-loss-free bias update after every step
    eval_every: int = 50
    eval_batches: int = 4
    log_every: int = 10
    out_dir: str = "runs/default"
    init_from: str = ""  # previous stage's checkpoint directory (params only, fresh optimiser)
    skip_nonfinite: bool = True  # a NaN/Inf loss or gradient skips the update and is reported
    peak_tflops: float = 0.0  # per-device peak for MFU; 0 = measure a float32 matmul at start-up
    tensorboard: bool = True


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = dataclasses.field(default_factory=CheckpointConfig)
    # logical axis -> mesh axes overrides of the default rules in sharding.py
    sharding_rules: Mapping[str, Any] = dataclasses.field(default_factory=dict)


# --------------------------------------------------------------------------------------------------
# Building dataclasses from nested dicts with type checking
# --------------------------------------------------------------------------------------------------


def _type_name(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if dataclasses.is_dataclass(tp):
        return f"a mapping of {tp.__name__} fields"
    return getattr(tp, "__name__", str(tp))


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {value!r}")
        return _build(tp, value, key)
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{key}={value!r} is not accepted; accepted: {_type_name(tp)}")
        return value
    if origin is tuple:
        # tuple[X, ...] from a YAML list (e.g. data.sources: a list of SourceConfig mappings);
        # a fixed-length tuple[X, Y] is checked element by element.
        if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        args = typing.get_args(tp)
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
        if args and len(args) != len(value):
            raise ConfigError(f"{key}: expected a list of {len(args)} items, got {value!r}")
        return tuple(_coerce(v, a, f"{key}[{i}]") for i, (v, a) in enumerate(zip(value, args))) if args else tuple(value)
    if origin in (Mapping, dict) or tp is dict:
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping, got {value!r}")
        return dict(value)
    if origin in (typing.Union, types.UnionType):
        errors = []
        for arg in typing.get_args(tp):
            if arg is type(None):
                if value is None:
                    return None
                continue
            try:
                return _coerce(value, arg, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(f"{key}={value!r}: expected {' or '.join(_type_name(a) for a in typing.get_args(tp))}")
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}={value!r}: expected a boolean (true/false)")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise ConfigError(f"{key}={value!r}: expected an integer")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}={value!r}: expected a number")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}={value!r}: expected a string")
        return value
    return value


def _build(cls: type, data: Mapping[str, Any], prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for k, v in data.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if k not in fields:
            close = difflib.get_close_matches(str(k), fields, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"unknown key {key!r}{hint}; accepted keys: {', '.join(sorted(fields))}")
        kwargs[k] = _coerce(v, hints[k], key)
    return cls(**kwargs)


def _set_path(tree: dict, path: Sequence[str], value: Any) -> None:
    node = tree
    for part in path[:-1]:
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(f"override {'.'.join(path)}: {part!r} is a value, not a section")
        node = child
    node[path[-1]] = value


def parse_overrides(overrides: Sequence[str]) -> list[tuple[list[str], Any]]:
    """`a.b=value` strings -> (path, YAML-parsed value). A key given twice is an error."""
    seen: set[str] = set()
    out = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. model.num_layers=2)")
        key, raw = item.split("=", 1)
        key = key.strip()
        if not key or any(not p for p in key.split(".")):
            raise ConfigError(f"override {item!r}: empty key part; use dotted keys like model.num_layers=2")
        if key in seen:
            raise ConfigError(f"override key {key!r} is given twice; give each key once")
        seen.add(key)
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: value is not valid YAML ({e})") from None
        out.append((key.split("."), value))
    return out


def _read_yaml(path: Path, stack: tuple[Path, ...] = ()) -> dict:
    """Read a YAML file; a top-level `base: other.yaml` (relative to the file) is merged under it."""
    if not path.exists():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    if path in stack:
        raise ConfigError(f"config {str(path)!r} includes itself through 'base'")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {str(path)!r} must hold a mapping at top level, got {type(data).__name__}")
    bases = data.pop("base", None)
    if bases is None:
        return data
    merged: dict = {}
    for b in [bases] if isinstance(bases, str) else list(bases):
        _deep_merge(merged, _read_yaml((path.parent / b).resolve(), stack + (path,)))
    _deep_merge(merged, data)
    return merged


def _deep_merge(dst: dict, src: Mapping) -> None:
    for k, v in src.items():
        if isinstance(v, Mapping) and isinstance(dst.get(k), dict):
            _deep_merge(dst[k], v)
        else:
            dst[k] = v


# --------------------------------------------------------------------------------------------------
# Validation of combinations
# --------------------------------------------------------------------------------------------------


def validate_model(m: ModelConfig) -> None:
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ConfigError(msg)

    for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size"):
        need(getattr(m, key) > 0, f"model.{key}={getattr(m, key)} must be a positive integer")
    need(m.num_experts >= 0, f"model.num_experts={m.num_experts} must be >= 0 (0 = dense model)")
    if m.attention_type == "mla":
        need(m.kv_lora_rank > 0, f"model.kv_lora_rank={m.kv_lora_rank} must be positive for MLA")
        need(m.q_lora_rank >= 0, f"model.q_lora_rank={m.q_lora_rank} must be >= 0 (0 = no query LoRA)")
        need(m.qk_rope_head_dim > 0 and m.qk_rope_head_dim % 2 == 0,
             f"model.qk_rope_head_dim={m.qk_rope_head_dim} must be a positive even number")
        need(m.qk_nope_head_dim >= 0 and m.v_head_dim > 0,
             f"model.qk_nope_head_dim={m.qk_nope_head_dim} / v_head_dim={m.v_head_dim} must be >= 0 / > 0")
    else:
        need(m.num_kv_heads > 0 and m.num_heads % m.num_kv_heads == 0,
             f"model.num_heads={m.num_heads} must be a multiple of model.num_kv_heads={m.num_kv_heads}")
        need(m.head_dim > 0 and m.head_dim % 2 == 0, f"model.head_dim={m.head_dim} must be a positive even number")
    if m.num_experts:
        need(0 < m.num_experts_per_tok <= m.num_experts,
             f"model.num_experts_per_tok={m.num_experts_per_tok} must be in 1..num_experts={m.num_experts}")
        need(m.moe_intermediate_size > 0, f"model.moe_intermediate_size={m.moe_intermediate_size} must be positive")
        need(m.num_shared_experts >= 0, f"model.num_shared_experts={m.num_shared_experts} must be >= 0")
        need(0 <= m.first_k_dense <= m.num_layers,
             f"model.first_k_dense={m.first_k_dense} must be in 0..num_layers={m.num_layers}")
        need(m.n_group >= 1 and m.num_experts % m.n_group == 0,
             f"model.n_group={m.n_group} must divide model.num_experts={m.num_experts}")
        need(1 <= m.topk_group <= m.n_group,
             f"model.topk_group={m.topk_group} must be in 1..n_group={m.n_group}")
        if m.topk_method != "greedy":
            per_group = m.num_experts // m.n_group
            need(m.topk_group * per_group >= m.num_experts_per_tok,
                 f"model.topk_group={m.topk_group} groups of {per_group} experts cannot supply "
                 f"num_experts_per_tok={m.num_experts_per_tok} experts; raise topk_group or n_group")
            if m.topk_method == "noaux_tc":
                need(per_group >= 2, f"model.topk_method='noaux_tc' scores groups by their top-2 experts, "
                     f"so each of the n_group={m.n_group} groups needs >= 2 experts (has {per_group})")
    need(m.num_mtp_layers >= 0, f"model.num_mtp_layers={m.num_mtp_layers} must be >= 0")
    need(m.moe_tile_size >= 1, f"model.moe_tile_size={m.moe_tile_size} must be >= 1")
    need(m.attn_block_q >= 1, f"model.attn_block_q={m.attn_block_q} must be >= 1")
    need(m.attn_block_k >= 1, f"model.attn_block_k={m.attn_block_k} must be >= 1")
    rs = m.rope_scaling
    if rs.type == "yarn":
        need(rs.factor >= 1.0, f"model.rope_scaling.factor={rs.factor} must be >= 1 for yarn")
        need(rs.original_max_position_embeddings > 0,
             f"model.rope_scaling.original_max_position_embeddings={rs.original_max_position_embeddings} must be positive")


def validate_mesh_for_model(mesh: MeshConfig, m: ModelConfig, num_devices: int | None) -> None:
    """Impossible model/mesh combinations: heads over tensor, experts over expert, devices."""
    for a in MESH_AXES:
        v = getattr(mesh, a)
        if v != -1 and v < 1:
            raise ConfigError(f"mesh.{a}={v} must be a positive integer or -1 (all remaining devices)")
    sizes = mesh.shape(num_devices) if num_devices is not None else {
        a: getattr(mesh, a) for a in MESH_AXES}
    tp, ep = sizes["tensor"], sizes["expert"]
    if tp > 0 and m.num_heads % tp:
        raise ConfigError(f"model.num_heads={m.num_heads} is not divisible by mesh.tensor={tp}; "
                          f"accepted tensor sizes: {[d for d in range(1, m.num_heads + 1) if m.num_heads % d == 0]}")
    if m.attention_type == "gqa" and tp > 0 and m.num_kv_heads % tp:
        raise ConfigError(f"model.num_kv_heads={m.num_kv_heads} is not divisible by mesh.tensor={tp}")
    if m.num_experts and ep > 0 and m.num_experts % ep:
        raise ConfigError(f"model.num_experts={m.num_experts} is not divisible by mesh.expert={ep}; "
                          f"accepted expert sizes: {[d for d in range(1, m.num_experts + 1) if m.num_experts % d == 0]}")
    if not m.num_experts and ep > 1:
        raise ConfigError(f"mesh.expert={ep} but the model is dense (model.num_experts=0); set mesh.expert=1")


def validate_train(t: TrainConfig, mesh: MeshConfig, num_devices: int | None) -> None:
    for key in ("seq_len", "batch_size", "micro_batches", "steps", "log_every", "eval_every"):
        if getattr(t, key) < 1:
            raise ConfigError(f"train.{key}={getattr(t, key)} must be a positive integer")
    if t.batch_size % t.micro_batches:
        raise ConfigError(f"train.batch_size={t.batch_size} is not divisible by train.micro_batches="
                          f"{t.micro_batches}; accepted micro_batches: "
                          f"{[d for d in range(1, t.batch_size + 1) if t.batch_size % d == 0]}")
    if num_devices is not None:
        sizes = mesh.shape(num_devices)
        if t.seq_len % (2 * sizes["context"]) and sizes["context"] > 1:
            raise ConfigError(f"train.seq_len={t.seq_len} must be divisible by 2 x mesh.context="
                              f"{2 * sizes['context']} (zigzag context-parallel layout)")
    if t.optimizer.lr <= 0 or t.optimizer.warmup_steps < 0:
        raise ConfigError(f"train.optimizer.lr={t.optimizer.lr} must be > 0 and warmup_steps="
                          f"{t.optimizer.warmup_steps} >= 0")


# --------------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------------


def config_from_dict(data: Mapping[str, Any], overrides: Sequence[str] = (), *,
                     num_devices: int | None | Literal["auto"] = "auto") -> Config:
    """Build and validate a `Config` from a nested mapping plus `key=value` overrides.

    num_devices: "auto" checks the mesh against `jax.device_count()`; None skips the device check
    (e.g. `inspect` on a hypothetical cluster mesh).
    """
    tree = _to_plain(data)
    for path, value in parse_overrides(overrides):
        _set_path(tree, path, value)
    cfg = _build(Config, tree, "")
    validate_model(cfg.model)
    if num_devices == "auto":
        import jax  # local: the environment server imports this module's siblings without JAX

        num_devices = jax.device_count()
    validate_mesh_for_model(cfg.mesh, cfg.model, num_devices)
    validate_train(cfg.train, cfg.mesh, num_devices)
    return cfg


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), *,
                num_devices: int | None | Literal["auto"] = "auto") -> Config:
    """Load `path` (YAML; may name a `base:` file to extend) and apply `key=value` overrides."""
    data = _read_yaml(Path(path).resolve()) if path is not None else {}
    return config_from_dict(data, overrides, num_devices=num_devices)


def _to_plain(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _to_plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, Mapping):
        return {k: _to_plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):  # tuples of sections (data.sources) -> YAML/JSON lists
        return [_to_plain(v) for v in obj]
    return obj


def to_dict(cfg: Any) -> dict:
    """A config dataclass as a plain nested dict (YAML/JSON serialisable)."""
    return _to_plain(cfg)
