"""The sampler core's compiled programs: prefill one row, prefill a group of rows, one decode step,
a chunk of decode steps; each a `CountedJit` (its compilations counted where XLA compiles it).

Shapes are static: prefills take [rows, bucket] tokens (power-of-two groups and buckets), decode
steps [slots, 1] over the [slots, max_len] cache, so a run compiles few programs (`Sampler`).
"""

from __future__ import annotations

import contextlib
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from composer_jax.config import ModelConfig
from composer_jax.inference.engine.counted_jit import CountedJit
from composer_jax.inference.engine.token_sampling import sample
from composer_jax.model.kv_cache import KVCache
from composer_jax.model.transformer import forward_cached
from composer_jax.sharding import MeshRules


def mesh_scope(mesh: Mesh | None) -> contextlib.AbstractContextManager:
    """`jax.set_mesh(mesh)`, or nothing for a single-device sampler."""
    return jax.set_mesh(mesh) if mesh is not None else contextlib.nullcontext()


def cache_row(cache: KVCache, slot: jax.Array, start: jax.Array | None = None) -> KVCache:
    """Cache row `slot` as a batch-1 cache of length `start` (default 0: a prefill rewrites it from
    the start; more: it continues after the row's first `start` cached positions)."""
    return KVCache(
        {
            s: {k: jax.lax.dynamic_slice_in_dim(v, slot, 1, axis=1) for k, v in d.items()}
            for s, d in cache.layers.items()
        },
        jnp.zeros((1,), jnp.int32) if start is None else jnp.reshape(start, (1,)).astype(jnp.int32),
    )


def put_cache_row(cache: KVCache, row: KVCache, slot: jax.Array, n: jax.Array) -> KVCache:
    """`cache` with row `slot` replaced by the batch-1 cache `row`, its length set to n."""
    layers = {
        s: {k: jax.lax.dynamic_update_slice_in_dim(v, row.layers[s][k], slot, axis=1) for k, v in d.items()}
        for s, d in cache.layers.items()
    }
    return KVCache(layers, cache.lengths.at[slot].set(n))


def prefill_row(
    params, cfg: ModelConfig, sharding, cache: KVCache, slot, tokens, n, temperature, top_k, top_p, seed
) -> tuple[KVCache, jax.Array, jax.Array, jax.Array | None, jax.Array]:
    """The prefill of `DecodePrograms.prefill` from position 0, also returning the prompt's final
    hidden states [1, bucket, E] (what the speculative prefill drafts from)."""
    out = forward_cached(params, tokens, cfg, cache_row(cache, slot), sharding=sharding, logits_at=(n - 1)[None])
    assert out.cache is not None
    cache = put_cache_row(cache, out.cache, slot, n)
    logits = out.logits[0]  # [1, V]: after the prompt's last token
    tok, lp = sample(logits, temperature[None], top_k[None], top_p[None], seed[None], n[None])
    routing = None if out.routing is None else out.routing[:, 0]
    return cache, tok[0], lp[0], routing, out.hidden


class DecodePrograms:
    """The plain (non-speculative) programs of a sampler of `slots` rows; `decode_chunk` steps per
    `decode_many` call. Each sampler has its own (their compilations count per sampler)."""

    def __init__(self, cfg: ModelConfig, slots: int, decode_chunk: int, sharding: MeshRules | None):
        self.cfg, self.slots, self.decode_chunk, self.sharding = cfg, slots, decode_chunk, sharding
        self.prefill = CountedJit(self._prefill_fn, donate_argnums=(1,))
        self.prefill_group = CountedJit(self._prefill_group_fn, donate_argnums=(1,))
        self.decode = CountedJit(self._decode_fn, donate_argnums=(1,))
        self.decode_many = CountedJit(self._decode_chunk_fn, donate_argnums=(1,))

    @property
    def compilations(self) -> int:
        return sum(p.compilations for p in (self.prefill, self.prefill_group, self.decode, self.decode_many))

    def _prefill_fn(self, params, cache: KVCache, slot, start, tokens, n, temperature, top_k, top_p, seed):
        """Prompt tokens int32[1, bucket] (n real) into cache row `slot` at positions start..start+n-1
        (the row's first `start` positions: a reused prefix); -> (cache, first token, its log-prob,
        routing of the prefilled tokens [moe_layers, bucket, k] or None)."""
        row = cache_row(cache, slot, start)
        out = forward_cached(params, tokens, self.cfg, row, sharding=self.sharding, logits_at=(n - 1)[None])
        assert out.cache is not None
        cache = put_cache_row(cache, out.cache, slot, start + n)
        logits = out.logits[0]  # [1, V]: after the prompt's last token
        tok, lp = sample(logits, temperature[None], top_k[None], top_p[None], seed[None], (start + n)[None])
        return cache, tok[0], lp[0], None if out.routing is None else out.routing[:, 0]

    def _prefill_group_fn(self, params, cache: KVCache, slots, start, tokens, n, temperature, top_k, top_p, seed):
        """Prompts int32[g, bucket] (n[j] real in row j) into cache rows `slots` at positions
        start[j]..start[j]+n[j]-1 (an index past the cache's rows marks a padding row, whose writes
        are dropped) in one forward; -> (cache, first tokens [g], their log-probs, routing of the
        prefilled tokens [moe_layers, g, bucket, k] or None)."""
        rows = KVCache(
            {
                s: {k: jnp.take(v, jnp.minimum(slots, self.slots - 1), axis=1) for k, v in d.items()}
                for s, d in cache.layers.items()
            },
            start,
        )
        out = forward_cached(params, tokens, self.cfg, rows, sharding=self.sharding, logits_at=n - 1)
        assert out.cache is not None
        layers = {
            s: {k: v.at[:, slots].set(out.cache.layers[s][k], mode="drop") for k, v in d.items()}
            for s, d in cache.layers.items()
        }
        cache = KVCache(layers, cache.lengths.at[slots].set(start + n, mode="drop"))
        logits = out.logits[:, 0]  # [g, V]: after each prompt's last token
        tok, lp = sample(logits, temperature, top_k, top_p, seed, start + n)
        return cache, tok, lp, out.routing

    def _decode_fn(self, params, cache: KVCache, tokens, active, temperature, top_k, top_p, seeds):
        """One token for every slot: tokens int32[S] (each slot's last token) -> (cache, next
        tokens, their log-probs, routing of the input tokens [moe_layers, S, k] or None)."""
        out = forward_cached(params, tokens[:, None], self.cfg, cache, sharding=self.sharding)
        assert out.cache is not None
        # idle slots stay where they are (their writes land past their length and are never seen)
        lengths = jnp.where(active, out.cache.lengths, cache.lengths)
        new_cache = KVCache(out.cache.layers, lengths)
        tok, lp = sample(out.logits[:, 0], temperature, top_k, top_p, seeds, lengths)
        routing = None if out.routing is None else out.routing[:, :, 0]
        return new_cache, tok, lp, routing

    def _decode_chunk_fn(self, params, cache: KVCache, tokens, active, remaining, stop_ids, *settings: Any):
        """Up to `decode_chunk` decode steps in one loop: tokens int32[S] (each slot's last token),
        remaining int32[S] (tokens each slot may still make), stop_ids int32[S, STOP_IDS_ON_DEVICE]
        (-1 = none). A slot stops on device after its max_tokens or a stop id; the loop ends when
        none is left or after the chunk. -> (cache, steps run, tokens int32[C, S], log-probs
        [C, S], routing [C, moe_layers, S, k] or None)."""
        c, s = self.decode_chunk, self.slots
        toks = jnp.zeros((c, s), jnp.int32)
        lps = jnp.zeros((c, s), jnp.float32)
        r_shape = jax.eval_shape(self._decode_fn, params, cache, tokens, active, *settings)[3]
        routing = None if r_shape is None else jnp.zeros((c, *r_shape.shape), r_shape.dtype)

        def body(carry):
            i, cache, last, live, left, toks, lps, routing = carry
            cache, tok, lp, r = self._decode_fn(params, cache, last, live, *settings)
            toks, lps = toks.at[i].set(tok), lps.at[i].set(lp)
            if routing is not None:
                routing = routing.at[i].set(r)
            left = left - live.astype(jnp.int32)
            live = live & (left > 0) & ~(tok[:, None] == stop_ids).any(axis=1)
            return i + 1, cache, jnp.where(live, tok, last), live, left, toks, lps, routing

        def cond(carry):
            return (carry[0] < c) & carry[3].any()

        carry = (jnp.int32(0), cache, tokens, active, remaining, toks, lps, routing)
        n, cache, _, _, _, toks, lps, routing = jax.lax.while_loop(cond, body, carry)
        return cache, n, toks, lps, routing
