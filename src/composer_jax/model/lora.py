"""Low-rank adapters (LoRA) over a frozen base, as pure functions over two trees.

The run trains a tree of adapters only (`adapter_specs`, parallel to the model's parameter tree):

    adapters = {"moe_layers": {"attn": {"lora": {"q_a": {"a": [L, embed, r], "b": [L, r, q_lora]}, ...}},
                               "moe":  {"lora": {"gate": {"a": [L, E, embed, r], "b": [L, E, r, f]}, ...}}},
                "dense_layers": {...}}

A projection W [*in, *out] gets A [*in, r] and B [r, *out] (A normal with std 1/sqrt(fan-in), B zero:
the adapted model starts as the base). `join(base, adapters, scale)` puts each block's adapters
next to its weights (its "lora" key, B already times alpha / r); the forward then computes
x W + (x A) B' in the attention projections and the dense MLP (`adapted_linear`: no [in, out]
product is formed, the weight gradient of W is never computed) and merges W + A B' for the routed
experts and MLA's kv_b (`merged_weight`): the experts' dispatch paths (ragged, tiled, gathered,
decode kernels, the expert-parallel exchange inside `shard_map`) all multiply by one weight stack,
and merging once per layer keeps them unchanged for one [E, in, out] temporary; kv_b is consumed
whole by the context-parallel and absorbed (cached) attention. `merged(base, adapters, scale)` is
the plain tree with every W replaced by W + scale A B: what samplers, exports and the cached
(inference) forward use.

Why not qwix (Tunix's LoRA and quantisation library): docs/rl.md, "LoRA".
"""

from __future__ import annotations

import zlib
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from composer_jax import specs as array_specs
from composer_jax.config import ModelConfig
from composer_jax.config.lora import LoraConfig, lora_targets
from composer_jax.model.layers import linear
from composer_jax.model.params import param_specs
from composer_jax.sharding import ShardingRules
from composer_jax.specs import ParamSpec

LORA = "lora"  # the key of a block's adapters in a joined tree
STACKS = ("dense_layers", "moe_layers")  # the MTP modules keep their base weights


def _in_dims(block: str, name: str) -> int:
    """How many leading (non-batch) axes of the weight are its input: attention's o contracts
    [heads, head_dim]; every other projection one axis."""
    return 2 if block == "attn" and name == "o" else 1


def _pair(spec: ParamSpec, batch: int, n_in: int, rank: int) -> dict[str, ParamSpec]:
    """The A/B specs of one weight whose first `batch` axes are batch axes (layers, experts)."""
    sh, ax = spec.shape, spec.logical_axes
    cut = batch + n_in
    a = ParamSpec(sh[:cut] + (rank,), ax[:cut] + ("lora_rank",), dtype="float32")
    b = ParamSpec(sh[:batch] + (rank,) + sh[cut:], ax[:batch] + ("lora_rank",) + ax[cut:], "zeros", dtype="float32")
    return {"a": a, "b": b}


def adapter_specs(m: ModelConfig, c: LoraConfig) -> dict[str, Any]:
    """The trainable tree of `ParamSpec`s (module docstring); float32 whatever the base dtype."""
    targets = lora_targets(c, m)
    base = param_specs(m)
    out: dict[str, Any] = {}
    for stack in STACKS:
        if stack not in base:
            continue
        blocks = {}
        for block, names in targets.items():
            if block not in base[stack] or not names:
                continue
            batch = 2 if block == "moe" else 1  # [layers, experts, ...] or [layers, ...]
            w = base[stack][block]
            blocks[block] = {LORA: {n: _pair(w[n], batch, _in_dims(block, n), c.rank) for n in names}}
        if blocks:
            out[stack] = blocks
    return out


def adapter_shardings(m: ModelConfig, c: LoraConfig, mesh: Mesh, rules: ShardingRules | None = None) -> Any:
    return array_specs.shardings(adapter_specs(m, c), mesh, rules)


def abstract_adapters(m: ModelConfig, c: LoraConfig, mesh: Mesh | None = None, rules: ShardingRules | None = None):
    return array_specs.abstract(adapter_specs(m, c), "float32", mesh, rules)


def init_adapters(
    m: ModelConfig, c: LoraConfig, key: jax.Array, mesh: Mesh | None = None, rules: ShardingRules | None = None
) -> dict:
    """Fresh adapters: A ~ normal(0, 1/fan-in), B = 0 (each leaf's key folded from its path)."""
    tree = adapter_specs(m, c)

    def init(key: jax.Array) -> dict:
        def one(path: str, spec: ParamSpec) -> jax.Array:
            if spec.init == "zeros":
                return jnp.zeros(spec.shape, jnp.float32)
            batch = 2 if "/moe/" in path else 1
            fan_in = 1
            for d in spec.shape[batch:-1]:
                fan_in *= d
            k = jax.random.fold_in(key, zlib.crc32(path.encode()))
            return jax.random.normal(k, spec.shape, jnp.float32) * fan_in**-0.5

        return array_specs.spec_map(one, tree)

    if mesh is None:
        return jax.jit(init)(key)
    return jax.jit(init, out_shardings=array_specs.shardings(tree, mesh, rules))(key)


def join(base: dict, adapters: dict, scale: float) -> dict:
    """`base` with each block's adapters under its "lora" key, B times `scale` (dicts copied along
    the adapted paths only; the base arrays are shared)."""
    out = dict(base)
    for k, v in adapters.items():
        if k == LORA:
            out[LORA] = {n: {"a": ab["a"], "b": ab["b"] * scale} for n, ab in v.items()}
        else:
            out[k] = join(base[k], v, scale)
    return out


def _delta(a: jax.Array, b: jax.Array, w_shape: tuple[int, ...]) -> jax.Array:
    """A [*batch, *in, r] @ B [*batch, r, *out] -> [*batch, *in, *out] (= w_shape)."""
    nb = a.ndim + b.ndim - 2 - len(w_shape)
    batch, r = a.shape[:nb], a.shape[-1]
    return jnp.matmul(a.reshape(*batch, -1, r), b.reshape(*batch, r, -1)).reshape(w_shape)


def merged_weight(p: dict, name: str) -> jax.Array:
    """Block `p`'s weight `name` with its adapter (if any) merged: W + A B' (B' already scaled)."""
    w = p[name]
    ab = p.get(LORA, {}).get(name)
    if ab is None:
        return w
    return (w.astype(jnp.float32) + _delta(ab["a"], ab["b"], w.shape)).astype(w.dtype)


def merge_nodes(tree: Any) -> Any:
    """A joined tree with every adapter merged into its weight and the "lora" keys gone."""
    if not isinstance(tree, dict):
        return tree
    out = {k: merge_nodes(v) for k, v in tree.items() if k != LORA}
    for name in tree.get(LORA, {}):
        out[name] = merged_weight(tree, name)
    return out


def merged(base: dict, adapters: dict, scale: float) -> dict:
    """The plain parameter tree of the adapted model: every adapted W replaced by W + scale A B."""
    return merge_nodes(join(base, adapters, scale))


def adapted_linear(x: jax.Array, p: dict, name: str, contract: int = 1) -> jax.Array:
    """`linear(x, p[name], contract)` plus, when block `p` adapts `name`, (x A) B' (B' scaled by
    `join`): the adapter's path costs rank-sized products only."""
    y = linear(x, p[name], contract)
    ab = p.get(LORA, {}).get(name) if isinstance(p, dict) else None
    if ab is None:
        return y
    return y + linear(linear(x, ab["a"], contract), ab["b"]).astype(y.dtype)


def adapter_bytes(adapters: Any) -> int:
    """Bytes of the adapter leaves (what a checkpoint's parameters and a publish hold)."""
    return sum(int(x.size) * jnp.dtype(x.dtype).itemsize for x in jax.tree.leaves(adapters))
