"""The sampler's speculative part: MTP drafts verified by the main model (`inference/engine/draft_verify.py`
has the rule and the draft block; this module holds their state and programs in a sampler).

`SpeculativeDecoder` owns what speculation adds to the core: MTP module 1's KV cache, each slot's k
drafts and their distributions, the draft head (over a draft vocabulary), the acceptance counts
(`stats`) and three compiled programs: the prefill (the main model's prefill, MTP over the prompt,
the first drafts), the verify step (k + 1 tokens per slot, accept/resample, the next drafts) and a
chunk of verify steps. Its steps read and write the core's main KV cache and record the emitted
tokens in the core's `SlotTable`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from composer_jax.config import ConfigError, ModelConfig
from composer_jax.inference.engine.counted_jit import CountedJit
from composer_jax.inference.engine.decode_programs import cache_row, mesh_scope, prefill_row, put_cache_row
from composer_jax.inference.engine.draft_verify import SpecStats, draft, draft_head_columns, draft_model, verify_drafts
from composer_jax.inference.engine.slot_table import Completion, SlotTable
from composer_jax.inference.engine.token_sampling import processed_logprobs
from composer_jax.model.kv_cache import KVCache, init_cache
from composer_jax.model.transformer import forward_cached
from composer_jax.sharding import MeshRules, ShardingRules


def checked_draft_vocab(draft_vocab: Sequence[int] | None, vocab_size: int) -> np.ndarray | None:
    """The draft vocabulary as sorted unique int32 ids (None: the whole vocabulary); raises
    ConfigError naming the bad ids."""
    if draft_vocab is None:
        return None
    ids = sorted({int(t) for t in draft_vocab})
    if not ids or ids[0] < 0 or ids[-1] >= vocab_size:
        raise ConfigError(
            f"draft_vocab: {len(ids)} ids from {ids[:1]} to {ids[-1:]}; give at least one id, all in "
            f"0..{vocab_size - 1}"
        )
    return np.asarray(ids, np.int32)


class SpeculativeDecoder:
    """k drafts per slot for a sampler of `slots` rows whose caches hold `cache_len` positions;
    `decode_chunk` verify steps per chunk call. draft_vocab: checked ids (`checked_draft_vocab`) or
    None; draft_experts: routed experts per token while drafting (`draft_verify.draft_model`)."""

    def __init__(
        self,
        params: Any,
        cfg: ModelConfig,
        *,
        k: int,
        slots: int,
        cache_len: int,
        decode_chunk: int = 1,
        mesh: Mesh | None = None,
        rules: ShardingRules | None = None,
        sharding: MeshRules | None = None,
        draft_vocab: np.ndarray | None = None,
        draft_experts: int | None = None,
    ):
        if k < 1:
            raise ValueError(f"speculative_tokens={k} must be >= 1 for a speculative decoder")
        if draft_experts is not None:
            draft_model(params, cfg, draft_experts)  # raises on a bad value
        self.cfg, self.k, self.slots, self.decode_chunk = cfg, k, slots, decode_chunk
        self.mesh, self.sharding = mesh, sharding
        self.draft_vocab, self.draft_experts = draft_vocab, draft_experts
        self.mtp_cache = init_cache(cfg, slots, cache_len, mesh, rules, mtp_modules=1)
        self.drafts = jnp.zeros((slots, k), jnp.int32)
        self.draft_lp = jnp.zeros((slots, k, cfg.vocab_size), jnp.float32)
        self.stats = SpecStats.zeros(k)
        self._head_of: Any = None  # the params the cached draft head columns belong to
        self._head: tuple[jax.Array, jax.Array] | None = None
        self.prefill = CountedJit(self._prefill_fn, donate_argnums=(1, 2, 3, 4))
        self.decode = CountedJit(self._decode_fn, donate_argnums=(1, 2, 3, 4))
        self.decode_many = CountedJit(self._chunk_fn, donate_argnums=(1, 2, 3, 4))

    @property
    def compilations(self) -> int:
        return self.prefill.compilations + self.decode.compilations + self.decode_many.compilations

    # ---------------------------------------------------------------------------- host side
    def draft_head(self, params: Any) -> tuple[jax.Array, jax.Array] | None:
        """(draft ids, the head's columns of them) for `params`, or None (the whole vocabulary)."""
        if self.draft_vocab is None:
            return None
        if self._head_of is not params:
            ids = jnp.asarray(self.draft_vocab)
            self._head = (ids, jax.jit(draft_head_columns, static_argnums=1)(params, self.cfg, ids))
            self._head_of = params
        return self._head

    def _state(self, params: Any, cache: KVCache) -> tuple:
        """The leading arguments of every program: (params, cache, MTP cache, drafts, their
        log-probs, the draft head)."""
        return params, cache, self.mtp_cache, self.drafts, self.draft_lp, self.draft_head(params)

    def admit(self, params: Any, cache: KVCache, i: int, args: tuple) -> tuple[KVCache, Any, Any, Any]:
        """Prefill slot i (args: tokens int32[1, bucket], n, temperature, top_k, top_p, seed) and
        draft its first k tokens. -> (cache, first token, its log-prob, prompt routing or None)."""
        with mesh_scope(self.mesh):
            cache, self.mtp_cache, self.drafts, self.draft_lp, tok, lp, routing = self.prefill(
                *self._state(params, cache), jnp.int32(i), *args
            )
        return cache, tok, lp, routing

    def step(self, params: Any, cache: KVCache, table: SlotTable, version: int) -> tuple[KVCache, list[Completion]]:
        """One verify step of every occupied slot; its tokens recorded in `table`."""
        active = table.active()
        *settings, active_dev = table.settings()
        with mesh_scope(self.mesh):
            cache, self.mtp_cache, self.drafts, self.draft_lp, tok, lp, acc, routing = self.decode(
                *self._state(params, cache), jnp.asarray(table.last), active_dev, *settings
            )
        tok, lp, acc = np.asarray(tok), np.asarray(lp), np.asarray(acc)
        routing_np = None if routing is None else np.asarray(routing)
        live = np.flatnonzero(active)
        self.stats.add(acc[live])
        done: list[Completion] = []
        for i in map(int, live):
            e = int(acc[i]) + 1
            rows = None if routing_np is None else np.moveaxis(routing_np[:, i, :e], 1, 0)
            done += table.emit(i, tok[i, :e], lp[i, :e], rows, version)
        return cache, done

    def chunk_step(
        self, params: Any, cache: KVCache, table: SlotTable, version: int
    ) -> tuple[KVCache, list[Completion]]:
        """Up to `decode_chunk` verify steps in one call; the tokens recorded step by step (a slot
        the host ended, by a stop string or a stop id past the on-device ones, drops the rest)."""
        active = table.active()
        *settings, active_dev = table.settings()
        remaining, stop_ids = table.on_device_limits(active)
        with mesh_scope(self.mesh):
            (cache, self.mtp_cache, self.drafts, self.draft_lp, n, tok, lp, acc, live, routing) = self.decode_many(
                *self._state(params, cache),
                jnp.asarray(table.last),
                active_dev,
                jnp.asarray(remaining),
                jnp.asarray(stop_ids),
                *settings,
            )
        n = int(n)
        tok, lp, acc, live = np.asarray(tok)[:n], np.asarray(lp)[:n], np.asarray(acc)[:n], np.asarray(live)[:n]
        routing_np = None if routing is None else np.asarray(routing)[:n]
        done: list[Completion] = []
        for j in range(n):
            verified = [i for i in map(int, np.flatnonzero(live[j])) if table.held[i] is not None]
            self.stats.add(acc[j, verified])
            for i in verified:
                e = int(acc[j, i]) + 1
                rows = None if routing_np is None else np.moveaxis(routing_np[j, :, i, :e], 1, 0)
                done += table.emit(i, tok[j, i, :e], lp[j, i, :e], rows, version)
        return cache, done

    # ---------------------------------------------------------------------------- programs
    def _prefill_fn(
        self, params, cache: KVCache, mtp_cache: KVCache, drafts, draft_lp, draft_head, slot, tokens, n, *settings
    ):
        """The main model's prefill of slot `slot` (`decode_programs.prefill_row`), then MTP module 1
        over the prompt (its cache row) and the first k drafts."""
        temperature, top_k, top_p, seed = settings
        cache, tok, lp, routing, hidden = prefill_row(
            params, self.cfg, self.sharding, cache, slot, tokens, n, *settings
        )
        # the token after each prompt position: the prompt shifted by one, the sampled token after n - 1
        after = jnp.concatenate([tokens[:, 1:], jnp.zeros((1, 1), tokens.dtype)], axis=1)
        after = jnp.where(jnp.arange(tokens.shape[1])[None, :] == n - 1, tok, after)
        row, d, q = draft(
            params,
            self.cfg,
            cache_row(mtp_cache, slot),
            hidden,
            after,
            n[None],
            self.k,
            temperature[None],
            top_k[None],
            top_p[None],
            seed[None],
            self.sharding,
            draft_head,
            self.draft_experts,
        )
        mtp_cache = put_cache_row(mtp_cache, row, slot, n)
        drafts = jax.lax.dynamic_update_slice_in_dim(drafts, d, slot, axis=0)
        draft_lp = jax.lax.dynamic_update_slice_in_dim(draft_lp, q, slot, axis=0)
        return cache, mtp_cache, drafts, draft_lp, tok, lp, routing

    def _decode_fn(
        self, params, cache: KVCache, mtp_cache: KVCache, drafts, draft_lp, draft_head, last, active, *settings
    ):
        """One verify step for every slot: its last token and k drafts int32[S, k+1] through the
        main model, the accept/resample rule, then MTP module 1 over the confirmed positions and the
        next k drafts. -> (cache, mtp_cache, drafts, draft_lp, tokens int32[S, k+1] and their
        log-probs (the first accepted + 1 are emitted), accepted int32[S], routing of the k+1 input
        tokens [moe_layers, S, k+1, topk] or None)."""
        temperature, top_k, top_p, seeds = settings
        k, s = self.k, self.slots
        # idle slots restart at 0 (their writes are never read): no window runs past the capacity
        lengths = jnp.where(active, cache.lengths, 0)
        window = jnp.concatenate([last[:, None], drafts], axis=1)
        out = forward_cached(params, window, self.cfg, KVCache(cache.layers, lengths), sharding=self.sharding)
        assert out.cache is not None
        each = lambda x: jnp.repeat(x, k + 1)
        p_lp = processed_logprobs(
            out.logits.reshape(s * (k + 1), -1), each(temperature), each(top_k), each(top_p)
        ).reshape(s, k + 1, -1)
        accepted, tokens, logprobs = verify_drafts(p_lp, draft_lp, drafts, temperature, seeds, lengths)
        new_lengths = jnp.where(active, lengths + accepted + 1, 0)
        mtp_cache, drafts, draft_lp = draft(
            params,
            self.cfg,
            KVCache(mtp_cache.layers, lengths),
            out.hidden,
            tokens,  # the token after each window position (drafts accepted, then the new one)
            new_lengths,
            k,
            temperature,
            top_k,
            top_p,
            seeds,
            self.sharding,
            draft_head,
            self.draft_experts,
        )
        cache = KVCache(out.cache.layers, new_lengths)
        return cache, mtp_cache, drafts, draft_lp, tokens, logprobs, accepted, out.routing

    def _chunk_fn(
        self,
        params,
        cache: KVCache,
        mtp_cache: KVCache,
        drafts,
        draft_lp,
        draft_head,
        last,
        active,
        remaining,
        stop_ids,
        *settings,
    ):
        """Up to `decode_chunk` verify steps (`_decode_fn`) in one loop, as the core's decode chunk
        does for plain steps: a slot stops on device once it has emitted `remaining` tokens or one
        of its `stop_ids` (int32[S, STOP_IDS_ON_DEVICE], -1 = none) among a step's emitted tokens,
        and from then on is idle (as a freed slot is in the next one-step call); the loop ends when
        no slot is live or after the chunk. Each step's last emitted token is the next step's input.
        -> (cache, mtp_cache, drafts, draft_lp, steps run, tokens int32[C, S, k+1], log-probs
        [C, S, k+1], accepted int32[C, S], live bool[C, S] (the slots each step verified), routing
        [C, moe_layers, S, k+1, topk] or None)."""
        c, s, k = self.decode_chunk, self.slots, self.k
        args = (params, cache, mtp_cache, drafts, draft_lp, draft_head, last, active, *settings)
        r_shape = jax.eval_shape(self._decode_fn, *args)[7]
        routing = None if r_shape is None else jnp.zeros((c, *r_shape.shape), r_shape.dtype)
        toks = jnp.zeros((c, s, k + 1), jnp.int32)
        lps = jnp.zeros((c, s, k + 1), jnp.float32)
        accs = jnp.zeros((c, s), jnp.int32)
        lives = jnp.zeros((c, s), bool)
        step = jnp.arange(k + 1, dtype=jnp.int32)[None, :]

        def body(carry):
            i, cache, mtp_cache, drafts, draft_lp, last, live, left, toks, lps, accs, lives, routing = carry
            cache, mtp_cache, drafts, draft_lp, tok, lp, acc, r = self._decode_fn(
                params, cache, mtp_cache, drafts, draft_lp, draft_head, last, live, *settings
            )
            toks, lps, accs, lives = toks.at[i].set(tok), lps.at[i].set(lp), accs.at[i].set(acc), lives.at[i].set(live)
            if routing is not None:
                routing = routing.at[i].set(r)
            emitted = step <= acc[:, None]  # [S, k+1]: the tokens this step emits
            stopped = (emitted & (tok[:, :, None] == stop_ids[:, None, :]).any(axis=2)).any(axis=1)
            left = left - jnp.where(live, acc + 1, 0)
            new_last = jnp.take_along_axis(tok, acc[:, None], axis=1)[:, 0]
            last = jnp.where(live, new_last, last)
            live = live & (left > 0) & ~stopped
            return i + 1, cache, mtp_cache, drafts, draft_lp, last, live, left, toks, lps, accs, lives, routing

        def cond(carry):
            return (carry[0] < c) & carry[6].any()

        state = (cache, mtp_cache, drafts, draft_lp, last, active, remaining)
        carry = (jnp.int32(0), *state, toks, lps, accs, lives, routing)
        n, cache, mtp_cache, drafts, draft_lp, _, _, _, toks, lps, accs, lives, routing = jax.lax.while_loop(
            cond, body, carry
        )
        return cache, mtp_cache, drafts, draft_lp, n, toks, lps, accs, lives, routing
