"""The KV cache for decoding: a pytree sharded by logical axes like the parameters.

MLA caches what its keys and values are made from, not the keys and values: the normalised latent
c_kv [kv_lora] and the rotated shared key k_rope [rope] per token (DeepSeek-V2 section 2.1.2),
576 numbers per token per layer for DeepSeek-V3 instead of 128 heads x (192 + 128). Decoding then
absorbs W_UK into the query and W_UV into the output (`attention.mla_cached`), so no per-head key
or value is ever expanded. GQA caches per-head keys (rotated, q/k-normed) and values.

Each row of the batch is its own sequence with its own length (continuous batching: a slot can
hold a new request while others continue): `lengths[b]` tokens of row b are valid, and a forward
pass with the cache appends the new tokens of each row at its own offset.

    cache = init_cache(cfg, batch=8, max_len=4096)                  # zeros, lengths 0
    out = forward_cached(params, prompt_tokens, cfg, cache)            # prefill (any number of tokens)
    out = forward_cached(params, next_tokens[:, None], cfg, out.cache)  # decode one token per row

The MTP modules have a cache of their own (`init_cache(..., mtp_modules=1)`: one stack "mtp", no
main-model layers), driven by `transformer.mtp_forward_cached` for speculative decoding: MTP
module d at position j attends over the module's earlier positions, exactly as in training.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from composer_jax import specs
from composer_jax.config import ModelConfig
from composer_jax.sharding import ShardingRules
from composer_jax.specs import ArraySpec

STACKS = ("dense_layers", "moe_layers", "mtp")


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """layers: per stack ("dense_layers", "moe_layers" present in the model; or "mtp" alone for the
    MTP modules' cache) a dict of arrays with
    a leading layers axis: MLA {"latent": [L, b, T, kv_lora], "k_rope": [L, b, T, rope]}, GQA
    {"k": [L, b, T, kv_heads, head_dim], "v": [L, b, T, kv_heads, head_dim]}. lengths: int32[b]
    valid tokens per row (T = capacity). The same container also holds the arrays' specs
    (`cache_specs`) and shardings (`specs.shardings` of them), hence the `Any` leaves."""

    layers: dict[str, dict[str, Any]]
    lengths: Any

    @property
    def capacity(self) -> int:
        first = next(iter(next(iter(self.layers.values())).values()))
        return int(first.shape[2])


def _stack_specs(cfg: ModelConfig, n: int, batch: int, max_len: int) -> dict[str, ArraySpec]:
    """One stack's cache arrays (n layers): MLA's latent and rotary key, or GQA's keys and values."""
    if cfg.attention_type == "mla":
        return {
            "latent": ArraySpec((n, batch, max_len, cfg.kv_lora_rank), ("layers", "act_batch", None, "kv_lora")),
            "k_rope": ArraySpec((n, batch, max_len, cfg.qk_rope_head_dim), ("layers", "act_batch", None, None)),
        }
    kv = ArraySpec(
        (n, batch, max_len, cfg.num_kv_heads, cfg.head_dim),
        ("layers", "act_batch", None, "act_kv_heads", "act_head_dim"),
    )
    return {"k": kv, "v": kv}


def cache_specs(cfg: ModelConfig, batch: int, max_len: int, mtp_modules: int = 0) -> KVCache:
    """The `KVCache` of `ArraySpec`s (zeros; the compute dtype unless given, lengths int32) of
    every cache array, per stack: the main model's layers, or with mtp_modules > 0 the first
    `mtp_modules` MTP modules only (stack "mtp")."""
    stacks = (
        (("mtp", mtp_modules),)
        if mtp_modules
        else (("dense_layers", cfg.num_dense_layers), ("moe_layers", cfg.num_moe_layers))
    )
    layers = {stack: _stack_specs(cfg, n, batch, max_len) for stack, n in stacks if n}
    return KVCache(layers, ArraySpec((batch,), ("act_batch",), dtype="int32"))


def init_cache(
    cfg: ModelConfig,
    batch: int,
    max_len: int,
    mesh: Mesh | None = None,
    rules: ShardingRules | None = None,
    *,
    mtp_modules: int = 0,
) -> KVCache:
    """An empty cache (zeros, every length 0) of `max_len` tokens per row, in the compute dtype;
    with a mesh, each array is created on its sharding (rows over the batch axes, MLA latent or GQA
    heads as the rules place activations). mtp_modules > 0: the cache of the first `mtp_modules`
    MTP modules instead of the main model's layers."""
    if max_len < 1 or batch < 1:
        raise ValueError(f"init_cache: batch={batch} and max_len={max_len} must be positive")
    if not 0 <= mtp_modules <= cfg.num_mtp_layers:
        raise ValueError(
            f"init_cache: mtp_modules={mtp_modules} must be in 0..model.num_mtp_layers={cfg.num_mtp_layers}"
        )
    if max_len > cfg.max_position_embeddings:
        raise ValueError(
            f"init_cache: max_len={max_len} exceeds model.max_position_embeddings={cfg.max_position_embeddings}"
        )
    return specs.zeros(cache_specs(cfg, batch, max_len, mtp_modules), cfg.compute_dtype, mesh, rules)


def write(cache_arr: jax.Array, new: jax.Array, start: jax.Array) -> jax.Array:
    """cache_arr [b, T, *], new [b, n, *], start int32[b] -> cache with new[b] at rows start[b]..+n.

    Writes past the capacity are dropped by the caller's length check (`forward` refuses them)."""
    put = lambda c, u, i: jax.lax.dynamic_update_slice(c, u.astype(c.dtype), (i,) + (0,) * (c.ndim - 1))
    return jax.vmap(put)(cache_arr, new, start)


def cached_visibility(lengths: jax.Array, new: int, capacity: int) -> jax.Array:
    """bool[b, 1, new, T]: query i of row b (position lengths[b] + i) sees cache slots
    0..lengths[b] + i (its own token included, every later or empty slot excluded).

    This is what makes speculative rollback free: entries written past a row's length (rejected
    draft tokens, a window's padding) are never read; the next pass that reaches those positions
    writes them again before any query can see them, since a pass writes its tokens at
    lengths[b] + 0..new-1 and query i sees nothing past lengths[b] + i."""
    q_pos = lengths[:, None] + jnp.arange(new, dtype=jnp.int32)[None, :]
    k_pos = jnp.arange(capacity, dtype=jnp.int32)
    return (k_pos[None, None, :] <= q_pos[:, :, None])[:, None]


def stack_slice(cache: KVCache | None, stack: str) -> Any:
    """The cache arrays of one layer stack (scanned over its leading layers axis), or None."""
    return None if cache is None else cache.layers.get(stack)
