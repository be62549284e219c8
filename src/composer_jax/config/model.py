"""The model section: architecture, numerics and implementation choices, and their validation."""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Literal

from composer_jax.errors import ConfigError

# accepted-name sets that other modules test against, each written once (the field's type; the
# tuple derived from it): quant/grouped_matmul.py's recipes and backends, model/moe/expert_parallel.py's
# exchanges
Dtype = Literal["float32", "bfloat16"]
DTYPES: tuple[str, ...] = typing.get_args(Dtype)
MoePrecision = Literal["bf16", "mxfp8", "nvfp4_fwd_mxfp8_bwd"]
MOE_PRECISIONS: tuple[str, ...] = typing.get_args(MoePrecision)
MoeQuantBackend = Literal["xla", "pallas"]
MOE_QUANT_BACKENDS: tuple[str, ...] = typing.get_args(MoeQuantBackend)
MoeEpExchange = Literal["auto", "padded", "ragged", "ragged_emulated"]
MOE_EP_EXCHANGES: tuple[str, ...] = typing.get_args(MoeEpExchange)


def as_dtype(value: str, what: str = "dtype") -> Dtype:
    """`value` as a parameter/compute dtype the model supports, or a ConfigError naming it."""
    if value not in DTYPES:
        raise ConfigError(f"{what}={value!r} is not supported; accepted: {', '.join(DTYPES)}")
    return typing.cast(Dtype, value)


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

    YAML_KEYS: typing.ClassVar[dict[str, str]] = {"from_": "from"}

    # `from: "hf:DIR"` (also "orbax:DIR", "run:DIR"): the architecture is that checkpoint's config
    # (hf/init_from.py, `resolve_model_from`; docs/models.md): a value from a file beneath the one
    # giving `from` gives way to it, one written beside `from` must equal it, one given on the
    # command line overrides it (logged). Weights still come from `train.init_from` only.
    from_: str = ""
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
    param_dtype: Dtype = "float32"
    compute_dtype: Dtype = "float32"
    # MoE matmul: "auto" = ragged_dot on GPU, tiled grouped matmul on CPU (ragged_dot does G x the
    # FLOPs on XLA:CPU); "dense" computes every expert for every token (reference, tiny models only)
    moe_impl: Literal["auto", "tiled", "ragged", "dense"] = "auto"
    moe_tile_size: int = 128
    # expert matmul precision (quant/grouped_matmul.py): "bf16" = no quantisation (the compute
    # dtype); "mxfp8" = MXFP8 E4M3 forward and backward; "nvfp4_fwd_mxfp8_bwd" = Composer 2's NVFP4
    # forward with a per-token second-level scale and MXFP8 backward. Not with moe_impl=dense.
    moe_precision: MoePrecision = "bf16"
    # where the quantised expert matmuls run (with moe_precision mxfp8 or nvfp4_fwd_mxfp8_bwd; no
    # effect with bf16): "xla" = the reference (exact dequantise + float32 matmul, runs anywhere);
    # "pallas" = the Pallas kernels of pallas_kernels/ for quantisation, forward, dgrad and wgrad
    # (compiled on a GPU, interpret mode on CPU: slow, for tests)
    moe_quant_backend: MoeQuantBackend = "xla"
    # expert-parallel exchange (model/moe/expert_parallel.py): "padded" = all_to_all of worst-case
    # [ep, tokens*k] buffers (moves ep x the rows that exist; never drops; the only one XLA:CPU
    # runs); "ragged" = jax.lax.ragged_all_to_all of the real rows only, counts exchanged first (GPU
    # and TPU; XLA:CPU fails to compile it); "ragged_emulated" = the ragged path's bookkeeping, bound
    # and drops with the collective emulated by a padded all_to_all (runs on CPU; tests);
    # "auto" = ragged on GPU/TPU, padded on CPU.
    moe_ep_exchange: MoeEpExchange = "auto"
    # ragged receive buffer per device, as a multiple of the balanced share (tokens*k rows): 0 = the
    # worst case tokens*k*min(ep, E/k), nothing can be dropped; c > 0 = ceil(c*tokens*k) rows (capped
    # at the worst case): less memory and matmul padding, and assignments past it are dropped and
    # counted (metric moe_dropped). The padded exchange ignores it (always the worst case).
    moe_ep_capacity_factor: float = 0.0
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


MODEL_FROM_KINDS = ("hf", "orbax", "run")
# where a model field was written relative to the layer that gives `from` (`ModelOrigin`)
BENEATH, BESIDE, OVERRIDE = "beneath", "beside", "override"
COMMAND_LINE = "the command line"


@dataclasses.dataclass(frozen=True)
class ModelOrigin:
    """Where the model section's fields were written, as the loader composed the config's layers
    (its YAML files in merge order, then the command line: config/run.py `model_origin`), for
    `model.from` (hf/init_from.py `resolve_model_from`). Not part of the YAML form: a run saves
    the resolved section.

    written: (field, role, where) per field some layer wrote, `where` a file or COMMAND_LINE, the
    role relative to the layer giving `from` (the last that writes it):
      BENEATH   an earlier file (a `base:` of it; every file when `from` is on the command line):
                the stage's default model, which the checkpoint replaces
      BESIDE    the file giving `from` or a later file: must agree with the checkpoint
      OVERRIDE  the command line: a deliberate override of the checkpoint, logged
    known: False for a config the loader did not build (each field that differs from its
    default then counts as BESIDE). resolved_from: the `from` the section was filled from (resolving
    again changes nothing)."""

    known: bool = False
    written: tuple[tuple[str, str, str], ...] = ()
    resolved_from: str = ""

    def role(self, name: str) -> tuple[str, str] | None:
        """(role, where) of field `name`, None when no layer wrote it."""
        return next(((r, w) for f, r, w in self.written if f == name), None)


# The fields that set parameter shapes (`model/params.param_specs`); tests/hf/test_init_from.py
# checks that no other field changes one.
SHAPE_KEYS: tuple[str, ...] = (
    "vocab_size",
    "hidden_size",
    "num_layers",
    "num_heads",
    "attention_type",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "num_kv_heads",
    "head_dim",
    "qk_norm",
    "intermediate_size",
    "moe_intermediate_size",
    "num_experts",
    "num_shared_experts",
    "first_k_dense",
    "tie_word_embeddings",
    "num_mtp_layers",
)
# Model keys a new stage may change while starting from the previous stage's parameters: they
# change no parameter shape (YaRN context extension, sequence limits, numerics, remat), or only
# record where the architecture was read (`from`).
STAGE_CHANGEABLE: tuple[str, ...] = (
    "model.from",
    "model.rope_scaling",
    "model.max_position_embeddings",
    "model.remat",
    "model.moe_impl",
    "model.moe_precision",
    "model.moe_quant_backend",
    "model.compute_dtype",
    "model.moe_tile_size",
    "model.router_bias_update_rate",
)
# ...and the keys a Hugging Face or `convert --to-orbax` checkpoint does not decide: how the run
# computes, not what (its name, initialiser, parameter dtype - loading casts - and kernels' choices).
IMPLEMENTATION_KEYS: tuple[str, ...] = STAGE_CHANGEABLE + (
    "model.name",
    "model.initializer_range",
    "model.param_dtype",
    "model.attention_impl",
    "model.attn_block_q",
    "model.attn_block_k",
    "model.scan_layers",
    "model.moe_ep_exchange",
    "model.moe_ep_capacity_factor",
)


def model_from(m: ModelConfig) -> tuple[str, str] | None:
    """`model.from` as (kind, directory), None when empty; a ConfigError naming a bad value."""
    if not m.from_:
        return None
    kind, sep, path = m.from_.partition(":")
    if not sep or kind not in MODEL_FROM_KINDS or not path:
        raise ConfigError(
            f"model.from={m.from_!r} is not accepted; accepted: '' (the model section as given) or KIND:DIR "
            f"with KIND one of {', '.join(MODEL_FROM_KINDS)}, e.g. 'hf:checkpoints/kimi_k2_5'"
        )
    return kind, path


def validate_model(m: ModelConfig) -> None:
    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise ConfigError(msg)

    model_from(m)

    for key in ("vocab_size", "hidden_size", "num_layers", "num_heads", "intermediate_size"):
        need(getattr(m, key) > 0, f"model.{key}={getattr(m, key)} must be a positive integer")
    need(m.num_experts >= 0, f"model.num_experts={m.num_experts} must be >= 0 (0 = dense model)")
    if m.attention_type == "mla":
        need(m.kv_lora_rank > 0, f"model.kv_lora_rank={m.kv_lora_rank} must be positive for MLA")
        need(m.q_lora_rank >= 0, f"model.q_lora_rank={m.q_lora_rank} must be >= 0 (0 = no query LoRA)")
        need(
            m.qk_rope_head_dim > 0 and m.qk_rope_head_dim % 2 == 0,
            f"model.qk_rope_head_dim={m.qk_rope_head_dim} must be a positive even number",
        )
        need(
            m.qk_nope_head_dim >= 0 and m.v_head_dim > 0,
            f"model.qk_nope_head_dim={m.qk_nope_head_dim} / v_head_dim={m.v_head_dim} must be >= 0 / > 0",
        )
    else:
        need(
            m.num_kv_heads > 0 and m.num_heads % m.num_kv_heads == 0,
            f"model.num_heads={m.num_heads} must be a multiple of model.num_kv_heads={m.num_kv_heads}",
        )
        need(m.head_dim > 0 and m.head_dim % 2 == 0, f"model.head_dim={m.head_dim} must be a positive even number")
    if m.num_experts:
        need(
            0 < m.num_experts_per_tok <= m.num_experts,
            f"model.num_experts_per_tok={m.num_experts_per_tok} must be in 1..num_experts={m.num_experts}",
        )
        need(m.moe_intermediate_size > 0, f"model.moe_intermediate_size={m.moe_intermediate_size} must be positive")
        need(m.num_shared_experts >= 0, f"model.num_shared_experts={m.num_shared_experts} must be >= 0")
        need(
            0 <= m.first_k_dense <= m.num_layers,
            f"model.first_k_dense={m.first_k_dense} must be in 0..num_layers={m.num_layers}",
        )
        need(
            m.n_group >= 1 and m.num_experts % m.n_group == 0,
            f"model.n_group={m.n_group} must divide model.num_experts={m.num_experts}",
        )
        need(1 <= m.topk_group <= m.n_group, f"model.topk_group={m.topk_group} must be in 1..n_group={m.n_group}")
        if m.topk_method != "greedy":
            per_group = m.num_experts // m.n_group
            need(
                m.topk_group * per_group >= m.num_experts_per_tok,
                f"model.topk_group={m.topk_group} groups of {per_group} experts cannot supply "
                f"num_experts_per_tok={m.num_experts_per_tok} experts; raise topk_group or n_group",
            )
            if m.topk_method == "noaux_tc":
                need(
                    per_group >= 2,
                    f"model.topk_method='noaux_tc' scores groups by their top-2 experts, "
                    f"so each of the n_group={m.n_group} groups needs >= 2 experts (has {per_group})",
                )
    need(m.num_mtp_layers >= 0, f"model.num_mtp_layers={m.num_mtp_layers} must be >= 0")
    need(m.moe_tile_size >= 1, f"model.moe_tile_size={m.moe_tile_size} must be >= 1")
    need(
        m.moe_precision == "bf16" or m.moe_impl != "dense",
        f"model.moe_precision={m.moe_precision!r} needs moe_impl auto, tiled or ragged "
        "(moe_impl=dense is the unquantised reference)",
    )
    need(
        m.moe_ep_exchange in MOE_EP_EXCHANGES,
        f"model.moe_ep_exchange={m.moe_ep_exchange!r} is not accepted; accepted: {', '.join(MOE_EP_EXCHANGES)}",
    )
    need(
        isinstance(m.moe_ep_capacity_factor, (int, float))
        and math.isfinite(m.moe_ep_capacity_factor)
        and m.moe_ep_capacity_factor >= 0,
        f"model.moe_ep_capacity_factor={m.moe_ep_capacity_factor!r} is not accepted; accepted: 0 (the "
        "worst case, never drops) or a finite number > 0 (a multiple of the balanced share tokens*k)",
    )
    need(m.attn_block_q >= 1, f"model.attn_block_q={m.attn_block_q} must be >= 1")
    need(m.attn_block_k >= 1, f"model.attn_block_k={m.attn_block_k} must be >= 1")
    rs = m.rope_scaling
    if rs.type == "yarn":
        need(rs.factor >= 1.0, f"model.rope_scaling.factor={rs.factor} must be >= 1 for yarn")
        need(
            rs.original_max_position_embeddings > 0,
            f"model.rope_scaling.original_max_position_embeddings={rs.original_max_position_embeddings} "
            "must be positive",
        )
