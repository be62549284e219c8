"""Typed parameter specs (shape, dtype, logical axes, initialiser) -> sharded init / eval_shape.

The parameter pytree is a nested dict. Layers of one kind are stacked on a leading `layers` axis
and run with `lax.scan` (dense layers first, then MoE layers, as DeepSeek's first_k_dense_replace).

    params = {
      "embed": [vocab, embed],
      "dense_layers": {"attn_norm", "attn": {...}, "mlp_norm", "mlp": {"gate", "up", "down"}},  # [L_dense, ...]
      "moe_layers":   {"attn_norm", "attn": {...}, "mlp_norm", "moe": {...}},                    # [L_moe, ...]
      "final_norm": [embed],
      "lm_head": [embed, vocab],                      # absent when tie_word_embeddings
      "mtp": {"enorm", "hnorm", "eh_proj", "layer": {...}, "norm"},                         # [D, ...]
    }
"""

from __future__ import annotations

import warnings
import zlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from composer_jax import specs as array_specs
from composer_jax.config import ModelConfig
from composer_jax.model.moe.params import moe_specs
from composer_jax.model.moe.router import router_bias_update
from composer_jax.sharding import ShardingRules
from composer_jax.specs import ParamSpec


def _is_spec(x: Any) -> bool:
    return isinstance(x, ParamSpec)


def _attention_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    d, h = cfg.hidden_size, cfg.num_heads
    if cfg.attention_type == "gqa":
        specs = {
            "q": ParamSpec((d, h, cfg.head_dim), ("embed", "heads", "head_dim")),
            "k": ParamSpec((d, cfg.num_kv_heads, cfg.head_dim), ("embed", "kv_heads", "head_dim")),
            "v": ParamSpec((d, cfg.num_kv_heads, cfg.head_dim), ("embed", "kv_heads", "head_dim")),
            "o": ParamSpec((h, cfg.head_dim, d), ("heads", "head_dim", "embed")),
        }
        if cfg.qk_norm:
            specs["q_norm"] = ParamSpec((cfg.head_dim,), ("head_dim",), "ones", role="norm")
            specs["k_norm"] = ParamSpec((cfg.head_dim,), ("head_dim",), "ones", role="norm")
        return specs
    qk = cfg.qk_head_dim
    specs = {}
    if cfg.q_lora_rank:
        specs["q_a"] = ParamSpec((d, cfg.q_lora_rank), ("embed", "q_lora"))
        specs["q_a_norm"] = ParamSpec((cfg.q_lora_rank,), ("q_lora",), "ones", role="norm")
        specs["q_b"] = ParamSpec((cfg.q_lora_rank, h, qk), ("lora_in", "heads", "head_dim"))
    else:
        specs["q"] = ParamSpec((d, h, qk), ("embed", "heads", "head_dim"))
    specs["kv_a"] = ParamSpec((d, cfg.kv_lora_rank + cfg.qk_rope_head_dim), ("embed", "kv_lora"))
    specs["kv_a_norm"] = ParamSpec((cfg.kv_lora_rank,), ("kv_lora",), "ones", role="norm")
    specs["kv_b"] = ParamSpec(
        (cfg.kv_lora_rank, h, cfg.qk_nope_head_dim + cfg.v_head_dim), ("lora_in", "heads", "head_dim")
    )
    specs["o"] = ParamSpec((h, cfg.v_head_dim, d), ("heads", "head_dim", "embed"))
    return specs


def _dense_mlp_specs(d: int, f: int) -> dict[str, ParamSpec]:
    return {
        "gate": ParamSpec((d, f), ("embed", "mlp")),
        "up": ParamSpec((d, f), ("embed", "mlp")),
        "down": ParamSpec((f, d), ("mlp", "embed")),
    }


def layer_specs(cfg: ModelConfig, moe: bool) -> dict[str, Any]:
    d = cfg.hidden_size
    layer: dict[str, Any] = {
        "attn_norm": ParamSpec((d,), ("embed",), "ones", role="norm"),
        "attn": _attention_specs(cfg),
        "mlp_norm": ParamSpec((d,), ("embed",), "ones", role="norm"),
    }
    if moe:
        layer["moe"] = moe_specs(cfg)
    else:
        layer["mlp"] = _dense_mlp_specs(d, cfg.intermediate_size)
    return layer


def _stack(tree: Any, n: int, axis: str) -> Any:
    return jax.tree.map(lambda s: s.stacked(n, axis), tree, is_leaf=_is_spec)


def param_specs(cfg: ModelConfig) -> dict[str, Any]:
    """The nested dict of `ParamSpec` describing every parameter of the model."""
    d, v = cfg.hidden_size, cfg.vocab_size
    specs: dict[str, Any] = {"embed": ParamSpec((v, d), ("vocab", "embed"), role="embedding")}
    if cfg.num_dense_layers:
        specs["dense_layers"] = _stack(layer_specs(cfg, moe=False), cfg.num_dense_layers, "layers")
    if cfg.num_moe_layers:
        specs["moe_layers"] = _stack(layer_specs(cfg, moe=True), cfg.num_moe_layers, "layers")
    specs["final_norm"] = ParamSpec((d,), ("embed",), "ones", role="norm")
    if not cfg.tie_word_embeddings:
        specs["lm_head"] = ParamSpec((d, v), ("embed", "vocab"))
    if cfg.num_mtp_layers:
        mtp = {
            "enorm": ParamSpec((d,), ("embed",), "ones", role="norm"),
            "hnorm": ParamSpec((d,), ("embed",), "ones", role="norm"),
            # DeepSeek-V3 layout: eh_proj(concat[enorm(emb(t_{i+k})), hnorm(h^{k-1}_i)])
            "eh_proj": ParamSpec((2 * d, d), ("embed_concat", "embed")),
            "layer": layer_specs(cfg, moe=cfg.num_experts > 0),
            "norm": ParamSpec((d,), ("embed",), "ones", role="norm"),
        }
        specs["mtp"] = _stack(mtp, cfg.num_mtp_layers, "mtp")
    return specs


def weight_decay_mask(cfg: ModelConfig) -> dict:
    """The parameter tree as booleans: True where AdamW applies weight decay (matrices; not norms,
    the embedding or the router bias)."""
    return jax.tree.map(lambda s: s.role == "weight", param_specs(cfg), is_leaf=_is_spec)


def gradient_free_mask(cfg: ModelConfig) -> dict:
    """The parameter tree as booleans: True where the optimiser must leave the leaf alone (the
    router score-correction biases, moved by `update_router_biases` instead)."""
    return jax.tree.map(lambda s: s.role == "router_bias", param_specs(cfg), is_leaf=_is_spec)


# Where each MoE stack's router bias lives, keyed by the name of its expert counts in
# `ModelOutput.aux` (the counts that drive the bias update).
ROUTER_BIAS_PATHS: dict[str, tuple[str, ...]] = {
    "expert_counts": ("moe_layers", "moe", "router_bias"),
    "mtp_expert_counts": ("mtp", "layer", "moe", "router_bias"),
}


def router_biases(params: dict) -> dict[str, jax.Array]:
    """counts key -> the stacked router bias float32[layers, experts] of each MoE stack present."""
    out = {}
    for key, path in ROUTER_BIAS_PATHS.items():
        node: Any = params
        for part in path:
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None:
            out[key] = node
    return out


def with_router_biases(params: dict, biases: dict[str, jax.Array]) -> dict:
    """A copy of `params` (dicts copied along the changed paths only) with new router biases."""

    def put(tree: dict, path: tuple[str, ...], value: jax.Array) -> dict:
        tree = dict(tree)
        tree[path[0]] = value if len(path) == 1 else put(tree[path[0]], path[1:], value)
        return tree

    for key, value in biases.items():
        params = put(params, ROUTER_BIAS_PATHS[key], value)
    return params


def update_router_biases(params: dict, counts: dict[str, jax.Array], rate: float) -> dict:
    """Apply `moe.router.router_bias_update` to every MoE stack's router bias (main layers and MTP).

    counts: the `expert_counts` / `mtp_expert_counts` of `ModelOutput.aux` summed over the batch,
    float32[layers, experts] each; stacks without counts keep their bias."""
    biases = router_biases(params)
    return with_router_biases(
        params, {k: router_bias_update(b, counts[k], rate) for k, b in biases.items() if k in counts}
    )


def _init_one(spec: ParamSpec, key: jax.Array, cfg: ModelConfig) -> jax.Array:
    dtype = array_specs.dtype_of(spec, cfg.param_dtype)
    if spec.init == "ones":
        return jnp.ones(spec.shape, dtype)
    if spec.init == "zeros":
        return jnp.zeros(spec.shape, dtype)
    return (cfg.initializer_range * jax.random.normal(key, spec.shape, jnp.float32)).astype(dtype)


def init_fn(cfg: ModelConfig) -> Callable[[jax.Array], dict]:
    """key -> params. Each leaf's key is folded from its path, so init does not depend on tree order."""
    specs = param_specs(cfg)

    def init(key: jax.Array) -> dict:
        def one(path: str, spec: ParamSpec) -> jax.Array:
            return _init_one(spec, jax.random.fold_in(key, zlib.crc32(path.encode())), cfg)

        return array_specs.spec_map(one, specs)

    return init


def _warn_unsplit_rules(cfg: ModelConfig, mesh: Mesh, rules: ShardingRules) -> None:
    """Warn about each `sharding_rules` entry the user gave that can split no parameter it names
    (its mesh axes divide none of their dimensions): those parameters stay replicated over that
    mesh axis, which is rarely what the rule meant."""
    applied: dict[tuple[str, str], bool] = {}
    for spec in jax.tree.leaves(param_specs(cfg), is_leaf=_is_spec):
        dropped = {(la, ma) for la, ma, _ in rules.dropped_axes(spec.logical_axes, spec.shape, mesh)}
        for la in set(spec.logical_axes) & rules.explicit:
            for ma in rules.mapped_axes(la):
                if mesh.shape[ma] > 1:
                    applied[(la, ma)] = applied.get((la, ma), False) or (la, ma) not in dropped
    for (la, ma), ok in sorted(applied.items()):
        if not ok:
            warnings.warn(
                f"sharding_rules.{la} maps to mesh axis {ma!r} (size {mesh.shape[ma]}), which divides no "
                f"parameter dimension named {la!r}: those parameters stay replicated over {ma!r}",
                stacklevel=3,
            )


def param_shardings(cfg: ModelConfig, mesh: Mesh, rules: ShardingRules | None = None) -> dict:
    """NamedSharding of every parameter (`specs.shardings` of `param_specs`). A `sharding_rules`
    entry the user gave that can split no parameter it names is warned about."""
    rules = rules or ShardingRules.create()
    _warn_unsplit_rules(cfg, mesh, rules)
    return array_specs.shardings(param_specs(cfg), mesh, rules)


def init_params(cfg: ModelConfig, key: jax.Array, mesh: Mesh | None = None, rules: ShardingRules | None = None) -> dict:
    """Create the parameters, each already placed on its sharding over `mesh` (no host copy of the
    whole model). `jax.eval_shape(lambda k: init_params(cfg, k, mesh), key)` allocates nothing."""
    fn = init_fn(cfg)
    if mesh is None:
        return jax.jit(fn)(key)
    return jax.jit(fn, out_shardings=param_shardings(cfg, mesh, rules))(key)


def abstract_params(cfg: ModelConfig, mesh: Mesh | None = None, rules: ShardingRules | None = None) -> dict:
    """ShapeDtypeStructs (with shardings when a mesh is given) of every parameter; no allocation."""
    if mesh is None:
        return array_specs.abstract(param_specs(cfg), cfg.param_dtype)
    rules = rules or ShardingRules.create()
    _warn_unsplit_rules(cfg, mesh, rules)
    return array_specs.abstract(param_specs(cfg), cfg.param_dtype, mesh, rules)


def count_params(tree: Any) -> int:
    """Number of scalars in a tree of ParamSpecs, arrays or ShapeDtypeStructs."""
    total = 0
    for leaf in jax.tree.leaves(tree, is_leaf=_is_spec):
        n = 1
        for dim in leaf.shape:
            n *= int(dim)
        total += n
    return total
