"""Parameter counts, training FLOPs per token and per-device memory of a model on a mesh.

Everything here is computed from the parameter specs (`param_specs`, shapes and logical axes) and
`jax.eval_shape` of the initialiser: no parameter is ever allocated, so a 1T-parameter model can be
inspected on a laptop. `composer-jax inspect` (inspection.py) prints what these functions return.

Conventions (stated once here and repeated in the report):
  - total / active parameters exclude the multi-token-prediction (MTP) modules, which are reported
    separately, as DeepSeek reports 671B (+14B MTP) and Moonshot 1.04T for Kimi K2;
  - active = everything a token touches: the embedding table and the output head counted in full
    (once each; once in all when tied), attention, dense MLPs, shared experts, routers and norms in
    full, and the routed experts at num_experts_per_tok / num_experts of their size;
  - training FLOPs per token = 6 x active matmul parameters (2 forward + 4 backward per
    multiply-add; the embedding gather is not a matmul and is excluded, the output head is
    included) + attention 12 x layers x heads x (qk_head_dim + v_head_dim) / 2 x S_ctx, where
    S_ctx = seq / 2 for causal attention (each query sees on average half the sequence; the
    convention of MaxText / torchtitan-style MFU) and S_ctx = seq for the PaLM / Megatron
    convention, reported alongside.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AbstractMesh

from composer_jax import specs as array_specs
from composer_jax.config import MESH_AXES, LoraConfig, ModelConfig
from composer_jax.model.params import abstract_params, param_specs
from composer_jax.sharding import ShardingRules
from composer_jax.specs import ParamSpec, path_str

COMPONENTS = (
    "embedding",
    "attention",
    "dense_mlp",
    "routed_experts",
    "shared_experts",
    "router",
    "norms",
    "lm_head",
    "mtp",
)

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}


@dataclasses.dataclass(frozen=True)
class ParamRow:
    """One parameter array: where it sits, how big it is, and how much of it one token uses."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    logical_axes: tuple[str, ...]
    component: str
    active_fraction: float  # share of the array one token's forward pass touches
    matmul: bool  # multiplied against activations (counts towards FLOPs); norms, biases, gathers not
    size: int  # number of scalars
    mesh_axes: tuple[str, ...]  # mesh axes (of size > 1) the array is split over; () = replicated
    shards: int  # product of those axes' sizes (1 = replicated)
    # (logical axis, mesh axis, dimension) the rules map but that cannot split the dimension (the
    # mesh axis does not divide it), so the array is replicated over that mesh axis instead
    unsplit: tuple[tuple[str, str, int], ...] = ()

    @property
    def bytes(self) -> int:
        return self.size * _BYTES[self.dtype]

    @property
    def bytes_per_device(self) -> int:
        return self.size // self.shards * _BYTES[self.dtype]


def abstract_mesh(sizes: Mapping[str, int]) -> AbstractMesh:
    """A device-free mesh with the five composer_jax axes, for sharding arithmetic only."""
    return AbstractMesh(tuple(int(sizes[a]) for a in MESH_AXES), MESH_AXES)


def _component(path: str, leaf: str) -> str:
    if path.startswith("mtp/"):
        return "mtp"
    if path == "embed":
        return "embedding"
    if path == "lm_head":
        return "lm_head"
    if leaf.endswith("norm"):  # attn_norm, mlp_norm, final_norm, q_a_norm, kv_a_norm, q_norm, k_norm
        return "norms"
    if "/attn/" in path:
        return "attention"
    if "/mlp/" in path:
        return "dense_mlp"
    if leaf in ("router", "router_bias"):
        return "router"
    if leaf.startswith("shared_"):
        return "shared_experts"
    if "/moe/" in path:
        return "routed_experts"
    raise ValueError(f"parameter {path!r} belongs to no known component; extend accounting._component")


def param_rows(
    cfg: ModelConfig, rules: ShardingRules | None = None, mesh_sizes: Mapping[str, int] | None = None
) -> list[ParamRow]:
    """Every parameter array of `cfg` with its component and, given a mesh, its shard count.

    Shapes and dtypes come from `jax.eval_shape` of the real initialiser (so they are what
    `init_params` would create), logical axes from `param_specs`; nothing is allocated.
    """
    return _rows(cfg, param_specs(cfg), abstract_params(cfg), rules, mesh_sizes)


def adapter_rows(
    cfg: ModelConfig, lora: LoraConfig, rules: ShardingRules | None = None, mesh_sizes: Mapping[str, int] | None = None
) -> list[ParamRow]:
    """The LoRA adapters' arrays (`train.lora`; model/lora.py's tree, float32) as `param_rows`
    gives the model's: each row's component is its adapted block's (attention, dense_mlp,
    routed_experts). Not counted in the model's FLOPs (the adapters' rank-r products are small)."""
    from composer_jax.model.lora import abstract_adapters, adapter_specs

    return _rows(cfg, adapter_specs(cfg, lora), abstract_adapters(cfg, lora), rules, mesh_sizes)


def frozen_base_bytes(
    cfg: ModelConfig, fmt: str, rules: ShardingRules | None = None, mesh_sizes: Mapping[str, int] | None = None
) -> dict[str, int]:
    """A LoRA run's frozen base as stored under `train.lora.base_format` = `fmt` (model/quant_base.py:
    the layers' linear kernels as codes + scales, the rest as it is): {"bytes", "bytes_per_device",
    "quantised_bytes" (the quantised kernels' codes and scales), "quantised_float_bytes" (the same
    kernels in the parameter dtype)}. Each stored array is split as its own logical axes say (a
    dimension its mesh axes do not divide stays whole)."""
    from composer_jax.model.quant_base import STORED_FIELDS, base_specs, quantised_axis

    rules = rules or ShardingRules.create()
    mesh = abstract_mesh(mesh_sizes) if mesh_sizes is not None else None
    out = {"bytes": 0, "bytes_per_device": 0, "quantised_bytes": 0, "quantised_float_bytes": 0}

    def nbytes(spec: Any) -> int:
        return math.prod(spec.shape) * jnp.dtype(spec.dtype or cfg.param_dtype).itemsize

    def stored(path: str, spec: Any) -> None:
        shards = 1
        if mesh is not None:
            for part in rules.spec(spec.logical_axes, spec.shape, mesh):
                for axis in () if part is None else (part,) if isinstance(part, str) else part:
                    shards *= mesh.shape[axis]
        out["bytes"] += nbytes(spec)
        out["bytes_per_device"] += nbytes(spec) // shards
        if path.rsplit("/", 1)[-1] in STORED_FIELDS:
            out["quantised_bytes"] += nbytes(spec)

    def original(path: str, spec: ParamSpec) -> None:
        if fmt != "none" and quantised_axis(path, spec) is not None:
            out["quantised_float_bytes"] += nbytes(spec)

    array_specs.spec_map(stored, base_specs(cfg, fmt))
    array_specs.spec_map(original, param_specs(cfg))
    return out


def _rows(
    cfg: ModelConfig, specs: Any, shapes: Any, rules: ShardingRules | None, mesh_sizes: Mapping[str, int] | None
) -> list[ParamRow]:
    rules = rules or ShardingRules.create()
    mesh = abstract_mesh(mesh_sizes) if mesh_sizes is not None else None
    spec_leaves = jax.tree_util.tree_flatten_with_path(specs, is_leaf=lambda x: isinstance(x, ParamSpec))[0]
    shape_leaves = jax.tree.leaves(shapes)
    assert len(spec_leaves) == len(shape_leaves), "param_specs and eval_shape(init) disagree"
    frac_routed = cfg.num_experts_per_tok / cfg.num_experts if cfg.num_experts else 1.0
    rows = []
    for (path, spec), sds in zip(spec_leaves, shape_leaves):
        assert tuple(sds.shape) == spec.shape, (path, sds.shape, spec.shape)
        p = path_str(path)
        leaf = p.rsplit("/", 1)[-1]
        comp = _component(p, leaf)
        routed = comp == "routed_experts" or (comp == "mtp" and "/moe/" in p and leaf in ("gate", "up", "down"))
        axes: tuple[str, ...] = ()
        unsplit: tuple[tuple[str, str, int], ...] = ()
        if mesh is not None:
            for part in rules.spec(spec.logical_axes, spec.shape, mesh):
                axes += () if part is None else (part,) if isinstance(part, str) else tuple(part)
            unsplit = tuple(rules.dropped_axes(spec.logical_axes, spec.shape, mesh))
        rows.append(
            ParamRow(
                path=p,
                shape=spec.shape,
                dtype=str(sds.dtype),
                logical_axes=spec.logical_axes,
                component=comp,
                active_fraction=frac_routed if routed else 1.0,
                matmul=not (leaf.endswith("norm") or leaf == "router_bias" or comp == "embedding"),
                size=math.prod(spec.shape),
                mesh_axes=axes,
                shards=math.prod(mesh.shape[a] for a in axes) if mesh is not None else 1,
                unsplit=unsplit,
            )
        )
    return rows


def breakdown(rows: list[ParamRow]) -> dict[str, dict[str, int]]:
    """component -> {total, active, bytes, bytes_per_device}; components without parameters omitted."""
    out: dict[str, dict[str, int]] = {}
    for c in COMPONENTS:
        rs = [r for r in rows if r.component == c]
        if rs:
            out[c] = {
                "total": sum(r.size for r in rs),
                "active": int(round(sum(r.size * r.active_fraction for r in rs))),
                "bytes": sum(r.bytes for r in rs),
                "bytes_per_device": sum(r.bytes_per_device for r in rs),
            }
    return out


def attention_dims(cfg: ModelConfig) -> tuple[int, int]:
    """(qk_head_dim, v_head_dim) of the attention scores / values."""
    if cfg.attention_type == "gqa":
        return cfg.head_dim, cfg.head_dim
    return cfg.qk_head_dim, cfg.v_head_dim


def flops_per_token(cfg: ModelConfig, rows: list[ParamRow], seq: int) -> dict[str, float]:
    """Training FLOPs per token (forward + backward) at sequence length `seq`; see module docstring.

    A tied output head multiplies by the embedding table, so it is added as a matmul then.
    """
    main = [r for r in rows if r.component != "mtp"]
    matmul_active = sum(r.size * r.active_fraction for r in main if r.matmul)
    head = cfg.vocab_size * cfg.hidden_size
    if cfg.tie_word_embeddings:
        matmul_active += head
    qk, v = attention_dims(cfg)
    per_ctx = 12 * cfg.num_layers * cfg.num_heads * (qk + v) / 2  # FLOPs per token per context token
    dense = 6 * matmul_active
    out = {
        "matmul_active_params": matmul_active,
        "matmul": dense,
        "attention_causal": per_ctx * seq / 2,
        "attention_full": per_ctx * seq,
        "total": dense + per_ctx * seq / 2,
        "total_full_attention": dense + per_ctx * seq,
    }
    mtp = [r for r in rows if r.component == "mtp"]
    if mtp:
        # each MTP depth: its own block + eh_proj, and one more pass through the shared output head
        mtp_matmul = sum(r.size * r.active_fraction for r in mtp if r.matmul) + cfg.num_mtp_layers * head
        mtp_attn = 12 * cfg.num_mtp_layers * cfg.num_heads * (qk + v) / 2 * seq / 2
        out["mtp"] = 6 * mtp_matmul + mtp_attn
    return out


# --------------------------------------------------------------------------------------------------
# Per-device memory
# --------------------------------------------------------------------------------------------------


def batch_shards(rules: ShardingRules, sizes: Mapping[str, int]) -> int:
    """How many ways the global batch is split (product of the act_batch mesh axes)."""
    return math.prod(sizes[a] for a in rules.mapped_axes("act_batch"))


def _layer_activation_bytes(cfg: ModelConfig, sizes: Mapping[str, int], seq: int, moe: bool) -> dict[str, float]:
    """Bytes per local token that one decoder layer's forward keeps alive with no remat, split into
    the part linear in the sequence and the attention-score part (linear in seq per token).

    Counted: norm inputs/outputs, every projection output, the MLP/expert hidden activations, and
    the attention state: with `attention_impl="dense"` the float32 scores, softmax and probabilities
    over all `seq` keys; with "blockwise" only the log-sum-exp and the joined key (the block's
    scores are transient, `attention_block_bytes`). With expert parallelism the dispatch uses
    worst-case buffers of ep x (tokens x k) rows (`model/moe/expert_parallel.py`'s padded
    exchange), so routed-expert terms scale with ep. Divided by the tensor axis where the model
    splits heads / MLP width.
    """
    c = _BYTES[cfg.compute_dtype]
    tp = sizes["tensor"]
    d = cfg.hidden_size
    h = cfg.num_heads / tp
    qk, v = attention_dims(cfg)
    if cfg.attention_type == "mla":
        attn = (
            cfg.q_lora_rank * 2
            + h * qk * 2
            + (cfg.kv_lora_rank + cfg.qk_rope_head_dim)
            + cfg.kv_lora_rank
            + h * (cfg.qk_nope_head_dim + v)
            + h * v
            + d
        )
    else:
        kvh = cfg.num_kv_heads / tp
        attn = h * qk * 2 + kvh * qk * 2 + kvh * v + h * v + d  # q, k (pre/post norm+rope), v, out, o
    linear = 4 * d + attn  # two norms' inputs and outputs
    if moe:
        k, e = cfg.num_experts_per_tok, cfg.num_experts
        f = cfg.moe_intermediate_size / tp
        ep = sizes["expert"]
        routed = k * (2 * d) + ep * k * (3 * f + 2 * d)  # sorted rows, gathered outputs; recv rows, h, y
        if ep > 1:
            routed += 3 * ep * k * d  # send buffer, return buffer, returned rows
        shared = cfg.num_shared_experts * (3 * cfg.moe_intermediate_size / tp) + (d if cfg.num_shared_experts else 0)
        linear += routed + shared + d
        linear_f32 = 2 * e  # router logits and scores stay float32
    else:
        linear += 3 * cfg.intermediate_size / tp + d
        linear_f32 = 0
    if cfg.attention_impl == "blockwise":
        # kept for the backward: the log-sum-exp (float32) and the heads-first key with the rotary
        # part joined (MLA); the per-block scores are transient (`attention_block_bytes`)
        scores = h * (4 + qk * c)
    else:
        scores = h * seq * (4 + 4 + c)
    return {"linear": linear * c + linear_f32 * 4, "scores": scores}


def attention_block_bytes(cfg: ModelConfig, sizes: Mapping[str, int], local_batch: float, seq: int) -> float:
    """Transient bytes of one blockwise-attention block (scores, probabilities, their gradient):
    local batch x heads x block_q x key chunk. Zero for the dense path (counted per token)."""
    if cfg.attention_impl != "blockwise":
        return 0.0
    h = cfg.num_heads / sizes["tensor"]
    return (
        local_batch * h * min(cfg.attn_block_q, seq) * min(cfg.attn_block_k, seq) * (4 + 4 + _BYTES[cfg.compute_dtype])
    )


def memory_per_device(
    cfg: ModelConfig,
    rows: list[ParamRow],
    rules: ShardingRules,
    sizes: Mapping[str, int],
    batch: int,
    seq: int,
    micro_batches: int = 1,
    *,
    fp32_master: bool = False,
    head_chunks: int | None = None,
    self_distill: bool = False,
    tiled_moe: bool = False,
) -> dict[str, Any]:
    """Estimated bytes per device for training at global `batch` sequences of `seq` tokens, in
    `micro_batches` gradient-accumulation steps.

    params: each array's bytes / its shard count. grads: the same (gradients take the parameter
    dtype and sharding); with micro-batches the accumulator and one micro-batch's gradient are both
    live. optimizer: AdamW's two moments per parameter, sharded like it, in the parameter dtype (what
    optax keeps by default, train/optimizer.py); with `fp32_master`, two float32 moments plus a
    float32 master copy of every bfloat16 parameter (12 bytes per bfloat16 parameter). fsdp_buffers:
    one stacked layer's weights gathered over the data-like axes plus its unreduced gradient (the working copy FSDP
    materialises per layer). activations: see `activation_bytes`, per micro-batch.
    """
    params = sum(r.bytes_per_device for r in rows)
    if fp32_master:
        opt = sum(r.size // r.shards * (8 + (4 if r.dtype == "bfloat16" else 0)) for r in rows)
    else:
        opt = 2 * params
    grads = params * (2 if micro_batches > 1 else 1)
    # FSDP working set: the largest stacked layer's per-layer slice with the data-like splits
    # (fsdp, and context / data when the rules shard parameters over them, ZeRO-3 style) undone;
    # the expert and tensor splits stay (the compute keeps them)
    stacks: dict[str, float] = {}
    for r in rows:
        stack = r.path.split("/", 1)[0]
        undone = math.prod(sizes[a] for a in r.mesh_axes if a in ("data", "fsdp", "context"))
        if r.logical_axes and r.logical_axes[0] in ("layers", "mtp") and undone > 1:
            per_layer = r.bytes_per_device / r.shape[0] * undone
            stacks[stack] = stacks.get(stack, 0.0) + per_layer
    layer_buffers = 2 * max(stacks.values(), default=0.0)
    # the output head gathered for the loss plus its unreduced gradient, and the embedding's
    # gradient (a scatter-add into the whole table) before it is reduce-scattered; a tied table
    # plays both parts
    gathered: dict[str, float] = {
        r.component: r.bytes_per_device * math.prod(sizes[a] for a in r.mesh_axes if a in ("data", "fsdp", "context"))
        for r in rows
        if r.component in ("embedding", "lm_head")
    }
    head_buffers = 2 * gathered.get("lm_head", gathered.get("embedding", 0.0)) + gathered.get("embedding", 0.0)
    fsdp_buffers = layer_buffers + head_buffers
    act = activation_bytes(
        cfg,
        rules,
        sizes,
        batch // micro_batches,
        seq,
        head_chunks=head_chunks,
        self_distill=self_distill,
        tiled_moe=tiled_moe,
    )
    total = params + grads + opt + fsdp_buffers + act["total"]
    return {
        "params": params,
        "grads": grads,
        "optimizer": opt,
        "fsdp_buffers": fsdp_buffers,
        "activations": act,
        "total": total,
    }


def moe_tile_weight_bytes(cfg: ModelConfig, sizes: Mapping[str, int], tokens: float) -> float:
    """Bytes of one MoE layer's per-tile expert weights on the tiled dispatch (moe/grouped.py
    `_grouped_tiled` / `tiled_dispatch_swiglu`): one [embed, f] x 3 copy per tile, with
    rows = (ep x) tokens x k assignments padded per expert to the tile size."""
    ep = sizes["expert"]
    rows = int(tokens) * cfg.num_experts_per_tok * ep
    groups = cfg.num_experts // ep
    avg = max(1, -(-rows // groups))
    m = int(max(8, min(cfg.moe_tile_size, 1 << (avg - 1).bit_length())))
    num_tiles = -(-rows // m) + groups
    return num_tiles * 3 * cfg.hidden_size * cfg.moe_intermediate_size / sizes["tensor"] * _BYTES[cfg.compute_dtype]


def activation_bytes(
    cfg: ModelConfig,
    rules: ShardingRules,
    sizes: Mapping[str, int],
    batch: int,
    seq: int,
    *,
    head_chunks: int | None = None,
    self_distill: bool = False,
    tiled_moe: bool = False,
) -> dict[str, Any]:
    """Stored activations per device for one micro-batch of `batch` sequences, by remat policy
    (cfg.remat), for T = batch/batch_shards x seq/context local tokens:

      none : every layer keeps everything (`_layer_activation_bytes` x layers);
      dots : every layer keeps its linear (projection / MLP) outputs but not the attention scores,
             which `checkpoint_dots_with_no_batch_dims` recomputes; plus one layer's scores live;
      full : every layer keeps only its input (T x hidden), plus one layer's working set twice
             while it is recomputed and differentiated in the backward pass (the recomputed forward
             and its cotangents; the factor 2 is measured against XLA, tests/test_inspect_xla.py).

    The loss: with `head_chunks` (the fused head + cross-entropy of train/losses.py, used unless
    MTP self-distillation needs the whole logits) three float32 [T/head_chunks, vocab/tensor] arrays
    (logits, exponentials, their gradient) live at once; otherwise four float32 [T, vocab/tensor]
    arrays for the main head (logits, log-softmax, softmax, gradient). Each MTP depth's head: four
    more, and three more with `self_distill` (the gathered teacher logits, its softmax, the KL
    gradient). For dense attention the causal mask (T x seq bools) shared by all layers; for
    blockwise attention one block's transient scores. With `tiled_moe` (the XLA:CPU dispatch,
    `moe_impl` tiled, or auto off an accelerator) each MoE layer also gathers one copy of its
    expert's weights per row tile (`_expert_weights_per_tile`): kept per layer without remat, one
    layer's (and its gradient) with remat=full.
    """
    local_batch = batch / batch_shards(rules, sizes)
    tokens = local_batch * seq / sizes["context"]
    c = _BYTES[cfg.compute_dtype]
    dense_l = _layer_activation_bytes(cfg, sizes, seq, moe=False)
    moe_l = _layer_activation_bytes(cfg, sizes, seq, moe=bool(cfg.num_experts))
    layers = [dense_l] * cfg.num_dense_layers + [moe_l] * cfg.num_moe_layers + [moe_l] * cfg.num_mtp_layers
    worst = max((a["linear"] + a["scores"] for a in layers), default=0.0)
    if cfg.remat == "none":
        per_token = sum(a["linear"] + a["scores"] for a in layers)
    elif cfg.remat == "dots":
        per_token = sum(a["linear"] for a in layers) + max(a["scores"] for a in layers)
    else:
        per_token = len(layers) * cfg.hidden_size * c + 2 * worst
    row = cfg.vocab_size / sizes["tensor"] * 4  # one float32 logit row
    mtp_arrays = cfg.num_mtp_layers * (4 + (3 if self_distill else 0))
    if head_chunks is None:
        logits = tokens * row * (4 + mtp_arrays)
    else:
        logits = 3 * tokens / head_chunks * row + tokens * row * mtp_arrays
    # the dense path builds a [q, k] mask shared by the layers; the blockwise one builds it per block
    mask = seq if cfg.attention_impl == "dense" else 0
    layer_part = tokens * per_token + attention_block_bytes(cfg, sizes, local_batch, seq)
    if tiled_moe and cfg.num_experts:
        tiles = moe_tile_weight_bytes(cfg, sizes, tokens)
        moe_layers = cfg.num_moe_layers + cfg.num_mtp_layers
        layer_part += tiles * (2 if cfg.remat == "full" else moe_layers + 1)
    total = layer_part + logits + tokens * mask
    return {
        "tokens_per_device": tokens,
        "layers": layer_part,
        "logits": logits,
        "mask": tokens * mask,
        "total": total,
        "remat": cfg.remat,
    }


def forward_bytes_per_token(cfg: ModelConfig, sizes: Mapping[str, int], seq: int) -> float:
    """A forward-only pass's live bytes per local token (no backward pass keeps anything): the
    residual stream into and out of a layer and the largest layer's working set
    (`_layer_activation_bytes`, linear and attention-score parts)."""
    layers = [_layer_activation_bytes(cfg, sizes, seq, moe=False)] if cfg.num_dense_layers else []
    if cfg.num_moe_layers:
        layers.append(_layer_activation_bytes(cfg, sizes, seq, moe=bool(cfg.num_experts)))
    worst = max((a["linear"] + a["scores"] for a in layers), default=0.0)
    return 2 * cfg.hidden_size * _BYTES[cfg.compute_dtype] + worst


def kv_bytes_per_token(cfg: ModelConfig, dtype: str) -> int:
    """Bytes one token adds to a decoder's KV cache in `dtype`: MLA caches the compressed latent and
    the shared rotary key (kv_lora_rank + qk_rope_head_dim values per layer, what the project's
    sampler and vLLM's MLA keep); GQA a key and a value per KV head and layer."""
    if cfg.attention_type == "mla":
        per_layer = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    else:
        per_layer = 2 * cfg.num_kv_heads * cfg.head_dim
    return cfg.num_layers * per_layer * _BYTES[dtype]


# FP8 serving (vLLM --quantization fp8, the DeepSeek-V3 / Kimi K2 hub checkpoints): the matmul weights
# of attention, dense MLPs and experts in float8_e4m3fn with one float32 scale per 128 x 128 block;
# the embedding, output head, norms and router stay bfloat16.
FP8_BLOCK = 128
_FP8_COMPONENTS = ("attention", "dense_mlp", "routed_experts", "shared_experts", "mtp")


def serving_weight_bytes(rows: list[ParamRow], precision: str) -> float:
    """Bytes of these parameter arrays served at `precision`: "bfloat16" / "float32" for every array,
    or "fp8" (`FP8_BLOCK` above: 1 byte per matmul weight plus 4 per 128 x 128 block, 2 bytes for
    the rest). Norms and biases (`matmul` False) stay bfloat16 under fp8 as well."""
    if precision in ("bfloat16", "float32"):
        return float(sum(r.size for r in rows) * _BYTES[precision])
    if precision != "fp8":
        raise ValueError(f"serving precision {precision!r} is not accepted; accepted: bfloat16, float32, fp8")
    total = 0.0
    for r in rows:
        if r.component in _FP8_COMPONENTS and r.matmul and len(r.shape) >= 2:
            lead = math.prod(r.shape[:-2])
            blocks = lead * math.ceil(r.shape[-2] / FP8_BLOCK) * math.ceil(r.shape[-1] / FP8_BLOCK)
            total += r.size + 4 * blocks
        else:
            total += 2 * r.size
    return total


def as_builtin(x: Any) -> Any:
    """numpy scalars -> Python numbers, recursively (for JSON)."""
    if isinstance(x, dict):
        return {k: as_builtin(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [as_builtin(v) for v in x]
    if isinstance(x, np.generic):
        return x.item()
    return x
