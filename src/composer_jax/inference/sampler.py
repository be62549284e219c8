"""The rollout sampler: a fixed number of KV-cache slots with continuous batching.

Requests of any prompt and output length join free slots and leave when done, between decode
steps; every decode step advances all occupied slots by one token with one compiled program
(static shapes: [slots, 1] tokens over a [slots, max_len] cache). The prompts admitted at one step
are prefilled together by the power-of-two bucket of what each prefills (a part of similar lengths
per program, so a short continuation is not padded to a long first prompt), each part a group of a
power-of-two rows (at most `slots`) padded to its longest row's bucket (speculative and mesh
samplers prefill one prompt at a time), so a run compiles the decode step once and the prefill once
per (group, bucket) it meets (`Sampler.compilations` counts them; `Sampler.warm_up` compiles them
all before the first request).

For every generated token the sampler records its log-probability under the sampling distribution,
the policy version of the weights that produced it, and for MoE models the experts it was routed to
in every layer (`routing`, the trainer's `routing=` replay input; prompt tokens' routing too).
`update_weights` swaps the parameters between two decode steps: running requests keep their KV
cache and continue under the new weights, and their later tokens carry the new version (PipelineRL's
in-flight weight update).

With `speculative_tokens=k` the MTP module drafts k tokens per slot and one compiled verify step
checks them with the main model ([slots, k+1] tokens), emitting 1..k+1 tokens per slot per step
with exactly the model's sampling distribution (`inference/speculative.py`); `spec_stats` counts
acceptance per depth. With `decode_chunk=N` as well, one compiled call runs up to N verify steps
(the accept, max-tokens and stop-id bookkeeping on device), with the tokens of N one-step calls.

Prefix reuse (`prefix_cache`, on by default): when a request leaves its slot, the slot's KV cache
row (the prompt and every generated token but the last, which no forward has seen) stays valid as
a cached prefix until the slot is reused; a new request takes the free slot whose cached tokens
share the longest prefix with its prompt (none or a tie: the least recently used one) and prefills
only the rest of the prompt, at the positions after the reused ones (the same (group, bucket)
programs with a per-row start: no compilation per request). The reused positions' routing comes
from the host's record of the earlier request, so `Completion.routing` stays complete. By
default ("version") the cached prefixes are dropped when the weights change, so a prompt's KV is
always the current weights' (what a fresh prefill computes); "keep" keeps them across versions (as
running requests keep theirs); "none" never reuses. Speculative samplers never reuse (their idle
verify windows overwrite free rows). `prefix_stats` counts reused and prefilled tokens.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from composer_jax.config import ModelConfig
from composer_jax.config.rl import PREFIX_CACHE_MODES
from composer_jax.inference.sampling import SamplingParams, processed_logprobs, sample
from composer_jax.inference.speculative import SpecStats, draft, draft_head_columns, draft_model, verify_drafts
from composer_jax.model.kv_cache import KVCache, init_cache
from composer_jax.model.transformer import forward
from composer_jax.sharding import MeshRules, ShardingRules

MIN_BUCKET = 16
STOP_IDS_ON_DEVICE = 8  # a request's first stop token ids, checked inside a decode chunk


@dataclasses.dataclass
class Request:
    """prompt: token ids; id: the caller's name for it (default: a counter)."""

    prompt: Sequence[int]
    params: SamplingParams = dataclasses.field(default_factory=SamplingParams)
    id: str = ""


@dataclasses.dataclass
class Completion:
    """tokens/logprobs/versions: one entry per generated token. routing: int32[tokens, moe_layers,
    k] experts of every prompt and generated token but the last generated one (which no forward
    pass has seen yet), None for dense models. finish_reason: "stop" (a stop token or string) or
    "length" (max_tokens)."""

    id: str
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    routing: np.ndarray | None
    finish_reason: str


@dataclasses.dataclass
class _Slot:
    request: Request
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    routing: list[np.ndarray] = dataclasses.field(default_factory=list)
    weights: int = 0  # Sampler._weights_gen when admitted: the weights its prefix and prefill ran with


@dataclasses.dataclass
class _Prefix:
    """A free slot's cached prefix: the tokens whose KV its cache row holds (positions 0..n-1) and
    the experts each was routed to ([moe_layers, k] each; empty for dense models)."""

    tokens: np.ndarray
    routing: list[np.ndarray]


@dataclasses.dataclass
class PrefixStats:
    """Admissions and prompt tokens: `reused` tokens taken from cached prefixes, `prefilled` ones
    computed by a prefill; `hits` admissions that reused at least one token."""

    admitted: int = 0
    hits: int = 0
    reused: int = 0
    prefilled: int = 0

    @property
    def hit_rate(self) -> float:
        """Share of admitted prompt tokens that were reused."""
        return self.reused / max(self.reused + self.prefilled, 1)

    def as_dict(self) -> dict[str, float]:
        return {**dataclasses.asdict(self), "hit_rate": self.hit_rate}


def _bucket(n: int, cap: int) -> int:
    return min(cap, max(MIN_BUCKET, 1 << (n - 1).bit_length()))


class Sampler:
    """Continuous-batching sampler over `slots` sequences of at most `max_len` tokens each.

    params: the model's parameters (placed on `mesh` if given); version: the policy version they
    are. detokenize: ids -> text, needed only for stop strings. speculative_tokens: k > 0 drafts k
    tokens per step with MTP module 1 and verifies them in one pass (needs model.num_mtp_layers >=
    1 and the MTP parameters; the KV caches then hold max_len + 2k positions: a verify window and
    the chained drafts reach up to 2k - 1 past the last confirmed token). draft_vocab: token ids
    the drafts are restricted to (a cheaper draft head, FR-Spec; `inference/speculative.py`);
    None = the whole vocabulary. draft_experts: routed experts per token in the MTP module's MoE
    block while drafting (0 = its shared expert only; None = the model's num_experts_per_tok), a
    cheaper draft (`speculative.draft_model`). None of these changes the output distribution. decode_chunk: decode steps
    (with speculation: verify steps) per compiled call: `step` then runs up to that many steps in one
    on-device loop, which ends early once every slot has reached its max_tokens or one of its first
    STOP_IDS_ON_DEVICE stop token ids; the host then records the tokens (stop strings and any further
    stop ids are checked there, and a request's tokens after its stop are dropped). Requests join,
    leave, are cancelled and see new weights between calls, so a larger chunk trades the granularity
    of continuous batching and streaming for fewer host round trips; the tokens are the same.
    prefix_cache: "version" (default) reuses a free slot's cached prefix computed with the current
    weights, "keep" one computed with any earlier weights too, "none" never (module docstring);
    speculative samplers ignore it (no reuse)."""

    def __init__(
        self,
        params: Any,
        cfg: ModelConfig,
        *,
        slots: int,
        max_len: int,
        version: int = 0,
        mesh: Mesh | None = None,
        rules: ShardingRules | None = None,
        detokenize: Callable[[list[int]], str] | None = None,
        speculative_tokens: int = 0,
        draft_vocab: Sequence[int] | None = None,
        decode_chunk: int = 1,
        prefix_cache: str = "version",
        draft_experts: int | None = None,
    ):
        k = speculative_tokens
        if prefix_cache not in PREFIX_CACHE_MODES:
            raise ValueError(
                f"prefix_cache={prefix_cache!r} is not accepted; accepted: {', '.join(PREFIX_CACHE_MODES)}"
            )
        if decode_chunk < 1:
            raise ValueError(f"decode_chunk={decode_chunk} must be >= 1 (decode steps per compiled call)")
        if k < 0:
            raise ValueError(f"speculative_tokens={k} must be >= 0 (0 = no speculative decoding)")
        if k and (cfg.num_mtp_layers < 1 or "mtp" not in params):
            raise ValueError(
                f"speculative_tokens={k} drafts with the MTP modules, but the model has none "
                f"(model.num_mtp_layers={cfg.num_mtp_layers}); use speculative_tokens=0"
            )
        if max_len + 2 * k > cfg.max_position_embeddings:
            raise ValueError(
                f"max_len={max_len} + 2 x speculative_tokens={k} exceeds model.max_position_embeddings="
                f"{cfg.max_position_embeddings}; lower max_len to at most {cfg.max_position_embeddings - 2 * k}"
            )
        self.cfg, self.slots, self.max_len = cfg, slots, max_len
        self.params, self.version = params, version
        self.mesh = mesh
        self.sharding = MeshRules(mesh, rules or ShardingRules.create()) if mesh is not None else None
        self.detokenize = detokenize
        self.speculative_tokens = k
        self.decode_chunk = decode_chunk
        self.draft_vocab = None
        if draft_vocab is not None:
            ids = sorted({int(t) for t in draft_vocab})
            if not ids or ids[0] < 0 or ids[-1] >= cfg.vocab_size:
                raise ValueError(
                    f"draft_vocab: {len(ids)} ids from {ids[:1]} to {ids[-1:]}; give at least one id, all in "
                    f"0..{cfg.vocab_size - 1}"
                )
            self.draft_vocab = np.asarray(ids, np.int32)
        self._draft_head_of: Any = None  # the params the cached draft head columns belong to
        self._draft_head_cache: tuple[jax.Array, jax.Array] | None = None
        self.draft_experts = draft_experts
        if draft_experts is not None:
            if not k:
                raise ValueError(
                    f"draft_experts={draft_experts} needs speculative_tokens >= 1 (it sets the drafts' cost)"
                )
            draft_model(params, cfg, draft_experts)  # raises on a bad value
        self.cache = init_cache(cfg, slots, max_len + 2 * k, mesh, rules)
        self.spec_stats = SpecStats.zeros(k)
        if k:
            self._mtp_cache = init_cache(cfg, slots, max_len + 2 * k, mesh, rules, mtp_modules=1)
            self._drafts = jnp.zeros((slots, k), jnp.int32)
            self._draft_lp = jnp.zeros((slots, k, cfg.vocab_size), jnp.float32)
        self._slot: list[_Slot | None] = [None] * slots
        self._waiting: collections.deque[Request] = collections.deque()
        self._ids = itertools.count()
        self.compilations = 0
        self._prefill = jax.jit(self._prefill_fn, donate_argnums=(1,))
        self._prefill_group = jax.jit(self._prefill_group_fn, donate_argnums=(1,))
        self._decode = jax.jit(self._decode_fn, donate_argnums=(1,))
        self._decode_many = jax.jit(self._decode_chunk_fn, donate_argnums=(1,))
        self._spec_prefill = jax.jit(self._spec_prefill_fn, donate_argnums=(1, 2, 3, 4))
        self._spec_decode = jax.jit(self._spec_decode_fn, donate_argnums=(1, 2, 3, 4))
        self._spec_decode_many = jax.jit(self._spec_chunk_fn, donate_argnums=(1, 2, 3, 4))
        # per-slot sampling settings and state, on the host; sent with every step
        self._last = np.zeros(slots, np.int32)
        self._settings_cache: tuple | None = None  # per-slot settings on the device; rebuilt when slots change
        # prefix reuse: each free slot's cached prefix (None: nothing reusable), when each slot was
        # last admitted to or left (least recently used first among equal matches), the weights' generation
        self.prefix_cache = prefix_cache
        self._reuse = prefix_cache != "none" and not k
        self._prefix: list[_Prefix | None] = [None] * slots
        self._used_at = [-1] * slots
        self._clock = itertools.count()
        self._weights_gen = 0
        self.prefix_stats = PrefixStats()
        self.prefill_s = 0.0  # seconds spent admitting requests (prefill, first token, compilations)
        self.prefill_trace_s = 0.0  # the part of prefill_s in admissions that traced a new program
        self.warm_up_s = 0.0  # seconds `warm_up` took (not part of prefill_s)

    # -------------------------------------------------------------------------------- programs
    def _prefill_fn(self, params, cache: KVCache, slot, start, tokens, n, temperature, top_k, top_p, seed):
        """Prompt tokens int32[1, bucket] (n real) into cache row `slot` at positions start..start+n-1
        (the row's first `start` positions: a reused prefix); -> (cache, first token, its log-prob,
        routing of the prefilled tokens [moe_layers, bucket, k] or None)."""
        self.compilations += 1  # runs once per trace: a new bucket size
        out = forward(
            params, tokens, self.cfg, cache=_row(cache, slot, start), sharding=self.sharding, logits_at=(n - 1)[None]
        )
        assert out.cache is not None
        cache = _put_row(cache, out.cache, slot, start + n)
        logits = out.logits[0]  # [1, V]: after the prompt's last token
        tok, lp = sample(logits, temperature[None], top_k[None], top_p[None], seed[None], (start + n)[None])
        return cache, tok[0], lp[0], None if out.routing is None else out.routing[:, 0]

    def _prefill_group_fn(self, params, cache: KVCache, slots, start, tokens, n, temperature, top_k, top_p, seed):
        """Prompts int32[g, bucket] (n[j] real in row j) into cache rows `slots` at positions
        start[j]..start[j]+n[j]-1 (an index past the cache's rows marks a padding row, whose writes
        are dropped) in one forward; -> (cache, first tokens [g], their log-probs, routing of the
        prefilled tokens [moe_layers, g, bucket, k] or None)."""
        self.compilations += 1  # once per (group size, bucket) met
        rows = KVCache(
            {
                s: {k: jnp.take(v, jnp.minimum(slots, self.slots - 1), axis=1) for k, v in d.items()}
                for s, d in cache.layers.items()
            },
            start,
        )
        out = forward(params, tokens, self.cfg, cache=rows, sharding=self.sharding, logits_at=n - 1)
        assert out.cache is not None
        layers = {
            s: {k: v.at[:, slots].set(out.cache.layers[s][k], mode="drop") for k, v in d.items()}
            for s, d in cache.layers.items()
        }
        cache = KVCache(layers, cache.lengths.at[slots].set(start + n, mode="drop"))
        logits = out.logits[:, 0]  # [g, V]: after each prompt's last token
        tok, lp = sample(logits, temperature, top_k, top_p, seed, start + n)
        return cache, tok, lp, out.routing

    def _prefill_row(self, params, cache: KVCache, slot, tokens, n, temperature, top_k, top_p, seed):
        """The prefill of `_prefill_fn`, also returning the prompt's final hidden states [1, bucket, E]."""
        out = forward(
            params, tokens, self.cfg, cache=_row(cache, slot), sharding=self.sharding, logits_at=(n - 1)[None]
        )
        assert out.cache is not None
        cache = _put_row(cache, out.cache, slot, n)
        logits = out.logits[0]  # [1, V]: after the prompt's last token
        tok, lp = sample(logits, temperature[None], top_k[None], top_p[None], seed[None], n[None])
        routing = None if out.routing is None else out.routing[:, 0]
        return cache, tok[0], lp[0], routing, out.hidden

    def _spec_prefill_fn(
        self,
        params,
        cache: KVCache,
        mtp_cache: KVCache,
        drafts,
        draft_lp,
        draft_head,
        slot,
        tokens,
        n,
        temperature,
        top_k,
        top_p,
        seed,
    ):
        """`_prefill_fn` plus MTP module 1 over the prompt (its cache row) and the first k drafts."""
        self.compilations += 1
        cache, tok, lp, routing, hidden = self._prefill_row(
            params, cache, slot, tokens, n, temperature, top_k, top_p, seed
        )
        # the token after each prompt position: the prompt shifted by one, the sampled token after n - 1
        after = jnp.concatenate([tokens[:, 1:], jnp.zeros((1, 1), tokens.dtype)], axis=1)
        after = jnp.where(jnp.arange(tokens.shape[1])[None, :] == n - 1, tok, after)
        row, d, q = draft(
            params,
            self.cfg,
            _row(mtp_cache, slot),
            hidden,
            after,
            n[None],
            self.speculative_tokens,
            temperature[None],
            top_k[None],
            top_p[None],
            seed[None],
            self.sharding,
            draft_head,
            self.draft_experts,
        )
        mtp_cache = _put_row(mtp_cache, row, slot, n)
        drafts = jax.lax.dynamic_update_slice_in_dim(drafts, d, slot, axis=0)
        draft_lp = jax.lax.dynamic_update_slice_in_dim(draft_lp, q, slot, axis=0)
        return cache, mtp_cache, drafts, draft_lp, tok, lp, routing

    def _decode_fn(self, params, cache: KVCache, tokens, active, temperature, top_k, top_p, seeds):
        """One token for every slot: tokens int32[S] (each slot's last token) -> (cache, next
        tokens, their log-probs, routing of the input tokens [moe_layers, S, k] or None)."""
        self.compilations += 1
        return self._decode_body(params, cache, tokens, active, temperature, top_k, top_p, seeds)

    def _decode_body(self, params, cache: KVCache, tokens, active, temperature, top_k, top_p, seeds):
        out = forward(params, tokens[:, None], self.cfg, cache=cache, sharding=self.sharding)
        assert out.cache is not None
        # idle slots stay where they are (their writes land past their length and are never seen)
        lengths = jnp.where(active, out.cache.lengths, cache.lengths)
        new_cache = KVCache(out.cache.layers, lengths)
        tok, lp = sample(out.logits[:, 0], temperature, top_k, top_p, seeds, lengths)
        routing = None if out.routing is None else out.routing[:, :, 0]
        return new_cache, tok, lp, routing

    def _decode_chunk_fn(self, params, cache: KVCache, tokens, active, remaining, stop_ids, *settings):
        """Up to `decode_chunk` decode steps in one loop: tokens int32[S] (each slot's last token),
        remaining int32[S] (tokens each slot may still make), stop_ids int32[S, STOP_IDS_ON_DEVICE]
        (-1 = none). A slot stops on device after its max_tokens or a stop id; the loop ends when
        none is left or after the chunk. -> (cache, steps run, tokens int32[C, S], log-probs
        [C, S], routing [C, moe_layers, S, k] or None)."""
        self.compilations += 1
        c, s = self.decode_chunk, self.slots
        toks = jnp.zeros((c, s), jnp.int32)
        lps = jnp.zeros((c, s), jnp.float32)
        r_shape = jax.eval_shape(self._decode_body, params, cache, tokens, active, *settings)[3]
        routing = None if r_shape is None else jnp.zeros((c, *r_shape.shape), r_shape.dtype)

        def body(carry):
            i, cache, last, live, left, toks, lps, routing = carry
            cache, tok, lp, r = self._decode_body(params, cache, last, live, *settings)
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

    def _spec_decode_fn(self, *args):
        """One verify step for every slot: its last token and k drafts int32[S, k+1] through the
        main model, the accept/resample rule, then MTP module 1 over the confirmed positions and the
        next k drafts. -> (cache, mtp_cache, drafts, draft_lp, tokens int32[S, k+1] and their
        log-probs (the first accepted + 1 are emitted), accepted int32[S], routing of the k+1 input
        tokens [moe_layers, S, k+1, topk] or None)."""
        self.compilations += 1
        return self._spec_body(*args)  # the arguments of `_spec_body`

    def _spec_body(
        self,
        params,
        cache: KVCache,
        mtp_cache: KVCache,
        drafts,
        draft_lp,
        draft_head,
        last,
        active,
        temperature,
        top_k,
        top_p,
        seeds,
    ):
        k, s = self.speculative_tokens, self.slots
        # idle slots restart at 0 (their writes are never read): no window runs past the capacity
        lengths = jnp.where(active, cache.lengths, 0)
        out = forward(
            params,
            jnp.concatenate([last[:, None], drafts], axis=1),
            self.cfg,
            cache=KVCache(cache.layers, lengths),
            sharding=self.sharding,
        )
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

    def _spec_chunk_fn(
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
        """Up to `decode_chunk` verify steps (`_spec_body`) in one loop, as `_decode_chunk_fn` does
        for plain steps: a slot stops on device once it has emitted `remaining` tokens or one of its
        `stop_ids` (int32[S, STOP_IDS_ON_DEVICE], -1 = none) among a step's emitted tokens, and from
        then on is idle (as a freed slot is in the next one-step call); the loop ends when no slot
        is live or after the chunk. Each step's last emitted token is the next step's input.
        -> (cache, mtp_cache, drafts, draft_lp, steps run, tokens int32[C, S, k+1], log-probs
        [C, S, k+1], accepted int32[C, S], live bool[C, S] (the slots each step verified), routing
        [C, moe_layers, S, k+1, topk] or None)."""
        self.compilations += 1
        c, s, k = self.decode_chunk, self.slots, self.speculative_tokens
        args = (params, cache, mtp_cache, drafts, draft_lp, draft_head, last, active, *settings)
        r_shape = jax.eval_shape(self._spec_body, *args)[7]
        routing = None if r_shape is None else jnp.zeros((c, *r_shape.shape), r_shape.dtype)
        toks = jnp.zeros((c, s, k + 1), jnp.int32)
        lps = jnp.zeros((c, s, k + 1), jnp.float32)
        accs = jnp.zeros((c, s), jnp.int32)
        lives = jnp.zeros((c, s), bool)
        step = jnp.arange(k + 1, dtype=jnp.int32)[None, :]

        def body(carry):
            i, cache, mtp_cache, drafts, draft_lp, last, live, left, toks, lps, accs, lives, routing = carry
            cache, mtp_cache, drafts, draft_lp, tok, lp, acc, r = self._spec_body(
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

        carry = (
            jnp.int32(0),
            cache,
            mtp_cache,
            drafts,
            draft_lp,
            last,
            active,
            remaining,
            toks,
            lps,
            accs,
            lives,
            routing,
        )
        n, cache, mtp_cache, drafts, draft_lp, _, _, _, toks, lps, accs, lives, routing = jax.lax.while_loop(
            cond, body, carry
        )
        return cache, mtp_cache, drafts, draft_lp, n, toks, lps, accs, lives, routing

    # -------------------------------------------------------------------------------- API
    def submit(self, request: Request | Sequence[int], params: SamplingParams | None = None) -> str:
        """Queue a request; it joins a free slot at the next `step`. Returns its id."""
        if not isinstance(request, Request):
            request = Request(list(request), params or SamplingParams())
        if not request.id:
            request.id = f"req-{next(self._ids)}"
        n, m = len(request.prompt), request.params.max_tokens
        if n < 1:
            raise ValueError(f"request {request.id}: the prompt is empty; give at least one token")
        if n + m > self.max_len:
            raise ValueError(
                f"request {request.id}: prompt {n} + max_tokens {m} = {n + m} tokens exceeds the sampler's "
                f"max_len={self.max_len}; shorten the prompt or lower max_tokens to at most {self.max_len - n}"
            )
        bad = [t for t in request.prompt if not 0 <= int(t) < self.cfg.vocab_size]
        if bad:
            raise ValueError(
                f"request {request.id}: token ids {bad[:5]} outside the vocabulary 0..{self.cfg.vocab_size - 1}"
            )
        if request.params.stop_strings and self.detokenize is None:
            raise ValueError(f"request {request.id}: stop_strings need a sampler built with detokenize=")
        self._waiting.append(request)
        return request.id

    def update_weights(self, params: Any, version: int) -> None:
        """New policy weights from the next decode step on; running requests continue (their KV
        cache, computed by the earlier weights, stays) and their later tokens carry `version`."""
        self.params, self.version = params, version
        self._weights_gen += 1
        if self.prefix_cache != "keep":  # the cached prefixes were computed with other weights
            self._prefix = [None] * self.slots

    def running(self) -> dict[str, tuple[list[int], list[float], list[int]]]:
        """Requests in a slot -> their (tokens, logprobs, versions) generated so far: the live lists,
        for streaming servers to read between steps (do not modify them)."""
        return {s.request.id: (s.tokens, s.logprobs, s.versions) for s in self._slot if s is not None}

    def cancel(self, request_id: str) -> bool:
        """Drop a waiting or running request (its slot is free from the next step on); no Completion
        is returned for it. Returns whether it was found."""
        for r in self._waiting:
            if r.id == request_id:
                self._waiting.remove(r)
                return True
        for i, s in enumerate(self._slot):
            if s is not None and s.request.id == request_id:
                self._release(i, s)
                return True
        return False

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """The (rows, bucket) shapes of every admission program this sampler can run: power-of-two
        groups up to `slots` (one row for speculative and mesh samplers, which admit one prompt at a
        time) by power-of-two buckets from MIN_BUCKET up to max_len (the last one max_len itself)."""
        rows, groups = 1, []
        while True:
            groups.append(min(rows, self.slots))
            if rows >= self.slots or self.speculative_tokens or self.mesh is not None:
                break
            rows *= 2
        buckets = sorted({_bucket(1 << e, self.max_len) for e in range(self.max_len.bit_length() + 1)})
        return [(g, b) for g in groups for b in buckets]

    def warm_up(self) -> int:
        """Trace and compile every admission program (`prefill_shapes`) before the first request, so
        no admission waits for a compilation (with JAX's persistent compilation cache, a later start
        loads them instead). Runs each program once on padding rows, which write nothing: the cache,
        its cached prefixes and the counters are unchanged. The decode program compiles at the first
        step as before. Only on an idle sampler; returns the programs traced."""
        if self.busy:
            raise RuntimeError("warm_up runs before any request is submitted (the sampler is busy)")
        if self.speculative_tokens or self.mesh is not None:
            raise ValueError(
                "warm_up compiles the grouped admission programs of a plain sampler; this one admits one "
                f"prompt at a time (speculative_tokens={self.speculative_tokens}, mesh="
                f"{'set' if self.mesh is not None else 'None'}): its programs compile at first use"
            )
        t0, before = time.perf_counter(), self.compilations
        for g, bucket in self.prefill_shapes():
            f32 = jnp.zeros(g, jnp.float32)
            self.cache, tok, *_ = self._prefill_group(
                self.params,
                self.cache,
                jnp.full(g, self.slots, jnp.int32),  # every row a padding row: no write lands
                jnp.zeros(g, jnp.int32),
                jnp.zeros((g, bucket), jnp.int32),
                jnp.ones(g, jnp.int32),
                f32,
                jnp.zeros(g, jnp.int32),
                f32 + 1.0,
                jnp.zeros(g, jnp.uint32),
            )
            tok.block_until_ready()
        self.warm_up_s += time.perf_counter() - t0
        return self.compilations - before

    @property
    def busy(self) -> bool:
        return bool(self._waiting) or any(s is not None for s in self._slot)

    def step(self) -> list[Completion]:
        """Admit waiting requests into free slots (prefill), then decode one token in every
        occupied slot. Returns the requests that finished."""
        done: list[Completion] = []
        t0, traced = time.perf_counter(), self.compilations
        admit = self._place()
        if self.speculative_tokens or self.mesh is not None:
            for i, request, reuse in admit:
                done += self._admit(i, request, reuse)
        else:
            for part in self._admission_parts(admit):
                done += self._admit_group(part)
        dt = time.perf_counter() - t0
        self.prefill_s += dt
        if self.compilations != traced:
            self.prefill_trace_s += dt
        active = np.array([s is not None for s in self._slot])
        if not active.any():
            return done
        if self.speculative_tokens and self.decode_chunk > 1:
            return done + self._spec_chunk_step(active)
        if self.speculative_tokens:
            return done + self._spec_step(active)
        if self.decode_chunk > 1:
            return done + self._chunk_step(active)
        *settings, active_dev = self._settings()
        ctx = jax.set_mesh(self.mesh) if self.mesh is not None else _null()
        with ctx:
            self.cache, tok, lp, routing = self._decode(
                self.params, self.cache, jnp.asarray(self._last), active_dev, *settings
            )
        tok, lp = np.asarray(tok), np.asarray(lp)
        routing_np = None if routing is None else np.asarray(routing)
        for i in map(int, np.flatnonzero(active)):
            slot = self._slot[i]
            assert slot is not None
            if routing_np is not None:
                slot.routing.append(routing_np[:, i])
            done += self._record(i, int(tok[i]), float(lp[i]))
        return done

    def run(
        self, requests: Iterable[Request | Sequence[int]], params: SamplingParams | None = None
    ) -> list[Completion]:
        """Submit every request and step until all are done; completions in submission order."""
        ids = [self.submit(r, params) for r in requests]
        out: dict[str, Completion] = {}
        while self.busy:
            for c in self.step():
                out[c.id] = c
        return [out[i] for i in ids]

    # -------------------------------------------------------------------------------- internals
    def _draft_head(self) -> tuple[jax.Array, jax.Array] | None:
        """(draft ids, the head's columns of them) for the current weights, or None."""
        if self.draft_vocab is None:
            return None
        if self._draft_head_of is not self.params:
            ids = jnp.asarray(self.draft_vocab)
            self._draft_head_cache = (ids, jax.jit(draft_head_columns, static_argnums=1)(self.params, self.cfg, ids))
            self._draft_head_of = self.params
        return self._draft_head_cache

    def _spec_state(self) -> tuple:
        """The leading arguments of every speculative program: (params, cache, MTP cache, drafts,
        their log-probs, the draft head)."""
        return self.params, self.cache, self._mtp_cache, self._drafts, self._draft_lp, self._draft_head()

    def _chunk_step(self, active: np.ndarray) -> list[Completion]:
        *settings, active_dev = self._settings()
        remaining, stop_ids = self._on_device_limits(active)
        ctx = jax.set_mesh(self.mesh) if self.mesh is not None else _null()
        with ctx:
            self.cache, n, tok, lp, routing = self._decode_many(
                self.params,
                self.cache,
                jnp.asarray(self._last),
                active_dev,
                jnp.asarray(remaining),
                jnp.asarray(stop_ids),
                *settings,
            )
        n = int(n)
        tok, lp = np.asarray(tok)[:n], np.asarray(lp)[:n]
        routing_np = None if routing is None else np.asarray(routing)[:n]
        done: list[Completion] = []
        for i in map(int, np.flatnonzero(active)):
            for j in range(n):
                slot = self._slot[i]
                if slot is None:  # finished at an earlier token of this chunk; the rest is dropped
                    break
                if routing_np is not None:
                    slot.routing.append(routing_np[j, :, i])
                done += self._record(i, int(tok[j, i]), float(lp[j, i]))
        return done

    def _on_device_limits(self, active: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(tokens each slot may still make int32[S], its first stop ids int32[S, STOP_IDS_ON_DEVICE],
        -1 = none) for the on-device checks of a chunk."""
        remaining = np.zeros(self.slots, np.int32)
        stop_ids = np.full((self.slots, STOP_IDS_ON_DEVICE), -1, np.int32)
        for i in map(int, np.flatnonzero(active)):
            slot = self._slot[i]
            assert slot is not None
            remaining[i] = slot.request.params.max_tokens - len(slot.tokens)
            ids = slot.request.params.stop_token_ids[:STOP_IDS_ON_DEVICE]
            stop_ids[i, : len(ids)] = ids
        return remaining, stop_ids

    def _spec_chunk_step(self, active: np.ndarray) -> list[Completion]:
        *settings, active_dev = self._settings()
        remaining, stop_ids = self._on_device_limits(active)
        ctx = jax.set_mesh(self.mesh) if self.mesh is not None else _null()
        with ctx:
            (self.cache, self._mtp_cache, self._drafts, self._draft_lp, n, tok, lp, acc, live, routing) = (
                self._spec_decode_many(
                    *self._spec_state(),
                    jnp.asarray(self._last),
                    active_dev,
                    jnp.asarray(remaining),
                    jnp.asarray(stop_ids),
                    *settings,
                )
            )
        n = int(n)
        tok, lp, acc, live = np.asarray(tok)[:n], np.asarray(lp)[:n], np.asarray(acc)[:n], np.asarray(live)[:n]
        routing_np = None if routing is None else np.asarray(routing)[:n]
        done: list[Completion] = []
        for j in range(n):
            # the slots this verify step served that the host has not ended (a stop string or a
            # stop id past the on-device ones ends a request here; its later steps are dropped)
            verified = [i for i in map(int, np.flatnonzero(live[j])) if self._slot[i] is not None]
            self.spec_stats.add(acc[j, verified])
            for i in verified:
                for t in range(int(acc[j, i]) + 1):
                    slot = self._slot[i]
                    if slot is None:  # finished on an earlier token of this step
                        break
                    if routing_np is not None:
                        slot.routing.append(routing_np[j, :, i, t])
                    done += self._record(i, int(tok[j, i, t]), float(lp[j, i, t]))
        return done

    def _spec_step(self, active: np.ndarray) -> list[Completion]:
        *settings, active_dev = self._settings()
        ctx = jax.set_mesh(self.mesh) if self.mesh is not None else _null()
        with ctx:
            self.cache, self._mtp_cache, self._drafts, self._draft_lp, tok, lp, acc, routing = self._spec_decode(
                *self._spec_state(),
                jnp.asarray(self._last),
                active_dev,
                *settings,
            )
        tok, lp, acc = np.asarray(tok), np.asarray(lp), np.asarray(acc)
        routing_np = None if routing is None else np.asarray(routing)
        live = np.flatnonzero(active)
        self.spec_stats.add(acc[live])
        done: list[Completion] = []
        for i in map(int, live):
            for j in range(int(acc[i]) + 1):
                slot = self._slot[i]
                if slot is None:  # finished on an earlier token of this step; the rest is dropped
                    break
                if routing_np is not None:
                    slot.routing.append(routing_np[:, i, j])  # the input token before tok[i, j]
                done += self._record(i, int(tok[i, j]), float(lp[i, j]))
        return done

    def _settings(self):
        if self._settings_cache is not None:
            return self._settings_cache
        reqs = [s.request.params if s is not None else SamplingParams() for s in self._slot]
        self._settings_cache = (
            jnp.asarray([p.temperature for p in reqs], jnp.float32),
            jnp.asarray([p.top_k for p in reqs], jnp.int32),
            jnp.asarray([p.top_p for p in reqs], jnp.float32),
            jnp.asarray([p.seed for p in reqs], jnp.uint32),
            jnp.asarray([p is not None for p in self._slot]),
        )
        return self._settings_cache

    def _place(self) -> list[tuple[int, Request, int]]:
        """Waiting requests into free slots, first come first served: each takes the free slot whose
        cached prefix shares the most tokens with its prompt (none or a tie: the least recently used
        slot). -> (slot, request, prompt tokens its cached prefix covers)."""
        free = [i for i in range(self.slots) if self._slot[i] is None]
        out: list[tuple[int, Request, int]] = []
        while free and self._waiting:
            request = self._waiting.popleft()
            prompt = np.asarray(request.prompt, np.int32)
            best = max(free, key=lambda i: (self._match(i, prompt), -self._used_at[i]))
            free.remove(best)
            out.append((best, request, self._match(best, prompt)))
        return out

    def _admission_parts(self, admit: list[tuple[int, Request, int]]) -> list[list[tuple[int, Request, int]]]:
        """The admitted requests split into prefill programs by the bucket of what each prefills:
        one program pads every row to its longest row's bucket and its rows to a power of two, so a
        30-token continuation beside a 400-token first prompt would cost a 512-token row. Parts of
        equal buckets, smallest first; a part joins the next larger one where the joined program has
        no more padded tokens (its power-of-two rows x bucket) than the two apart."""
        rows = lambda n: min(self.slots, 1 << (n - 1).bit_length())
        by: dict[int, list[tuple[int, Request, int]]] = {}
        for item in admit:
            by.setdefault(_bucket(len(item[1].prompt) - item[2], self.max_len), []).append(item)
        parts: list[tuple[int, list[tuple[int, Request, int]]]] = []
        for bucket in sorted(by):
            part = by[bucket]
            if parts:
                b0, prev = parts[-1]
                if rows(len(prev) + len(part)) * bucket <= rows(len(prev)) * b0 + rows(len(part)) * bucket:
                    parts[-1] = (bucket, prev + part)
                    continue
            parts.append((bucket, part))
        return [p for _, p in parts]

    def _match(self, i: int, prompt: np.ndarray) -> int:
        """Leading prompt tokens slot i's cached prefix holds (at most all but the last prompt
        token: a prefill needs one token to compute the next one's distribution)."""
        prefix = self._prefix[i]
        if prefix is None:
            return 0
        k = min(len(prefix.tokens), len(prompt) - 1)
        same = prefix.tokens[:k] == prompt[:k]
        return k if same.all() else int(np.argmin(same))

    def _take_prefix(self, i: int, request: Request, reuse: int) -> list[np.ndarray]:
        """Slot i is taken by `request`, `reuse` of whose prompt tokens its cached prefix covers:
        count it and return the routing of those tokens (the cache row is the new request's now)."""
        prefix, self._prefix[i] = self._prefix[i], None
        self._used_at[i] = next(self._clock)
        st = self.prefix_stats
        st.admitted, st.hits = st.admitted + 1, st.hits + (reuse > 0)
        st.reused, st.prefilled = st.reused + reuse, st.prefilled + len(request.prompt) - reuse
        return [] if prefix is None or not reuse else prefix.routing[:reuse]

    def _release(self, i: int, slot: _Slot) -> None:
        """Slot i's request left (finished or cancelled): the slot is free; its cache row holds the
        KV of the prompt and of every generated token but the last (never forwarded), a prefix
        later requests may reuse if it was computed with the current weights (or prefix_cache="keep")."""
        self._slot[i] = None
        self._settings_cache = None
        self._used_at[i] = next(self._clock)
        if self._reuse and (self.prefix_cache == "keep" or slot.weights == self._weights_gen):
            tokens = np.asarray([*slot.request.prompt, *slot.tokens[:-1]], np.int32)
            self._prefix[i] = _Prefix(tokens, slot.routing)

    def _admit_group(self, admit: list[tuple[int, Request, int]]) -> list[Completion]:
        """Prefill the requests into their slots in one program: a group of a power-of-two rows
        (padding rows write nothing), each prompt's part past its reused prefix padded to the
        longest such part's bucket (a reused prefix is cut short where that bucket would run past
        the cache's end)."""
        g = min(self.slots, 1 << (len(admit) - 1).bit_length())
        bucket = max(_bucket(len(r.prompt) - reuse, self.max_len) for _, r, reuse in admit)
        tokens = np.zeros((g, bucket), np.int32)
        slots = np.full(g, self.slots, np.int32)  # past the cache's rows: a padding row
        start = np.zeros(g, np.int32)
        n = np.ones(g, np.int32)
        reqs = [SamplingParams()] * g
        prefix_routing = []
        for j, (i, request, reuse) in enumerate(admit):
            start[j] = min(reuse, self.max_len - bucket)
            n[j] = len(request.prompt) - start[j]
            tokens[j, : n[j]] = request.prompt[start[j] :]
            slots[j], reqs[j] = i, request.params
            prefix_routing.append(self._take_prefix(i, request, int(start[j])))
        self.cache, tok, lp, routing = self._prefill_group(
            self.params,
            self.cache,
            jnp.asarray(slots),
            jnp.asarray(start),
            jnp.asarray(tokens),
            jnp.asarray(n),
            jnp.asarray([p.temperature for p in reqs], jnp.float32),
            jnp.asarray([p.top_k for p in reqs], jnp.int32),
            jnp.asarray([p.top_p for p in reqs], jnp.float32),
            jnp.asarray([p.seed for p in reqs], jnp.uint32),
        )
        tok, lp = np.asarray(tok), np.asarray(lp)
        routing_np = None if routing is None else np.asarray(routing)
        done: list[Completion] = []
        for j, (i, request, _) in enumerate(admit):
            slot = _Slot(request, routing=prefix_routing[j], weights=self._weights_gen)
            if routing_np is not None:
                slot.routing.extend(np.moveaxis(routing_np[:, j, : n[j]], 1, 0))
            self._slot[i] = slot
            done += self._record(i, int(tok[j]), float(lp[j]))
        self._settings_cache = None
        return done

    def _admit(self, i: int, request: Request, reuse: int) -> list[Completion]:
        """Prefill one request into slot i (past the `reuse` prompt tokens its cached prefix covers,
        fewer where the bucket would run past the cache's end)."""
        bucket = _bucket(len(request.prompt) - reuse, self.max_len)
        start = min(reuse, self.max_len - bucket)
        n = len(request.prompt) - start
        tokens = np.zeros((1, bucket), np.int32)
        tokens[0, :n] = request.prompt[start:]
        prefix_routing = self._take_prefix(i, request, start)
        p = request.params
        args = (
            jnp.asarray(tokens),
            jnp.int32(n),
            jnp.float32(p.temperature),
            jnp.int32(p.top_k),
            jnp.float32(p.top_p),
            jnp.uint32(p.seed),
        )
        ctx = jax.set_mesh(self.mesh) if self.mesh is not None else _null()
        with ctx:
            if self.speculative_tokens:
                self.cache, self._mtp_cache, self._drafts, self._draft_lp, tok, lp, routing = self._spec_prefill(
                    *self._spec_state(),
                    jnp.int32(i),
                    *args,
                )
            else:
                self.cache, tok, lp, routing = self._prefill(
                    self.params, self.cache, jnp.int32(i), jnp.int32(start), *args
                )
        slot = _Slot(request, routing=prefix_routing, weights=self._weights_gen)
        if routing is not None:
            slot.routing.extend(np.moveaxis(np.asarray(routing)[:, :n], 1, 0))
        self._slot[i] = slot
        self._settings_cache = None
        return self._record(i, int(tok), float(lp))

    def _record(self, i: int, token: int, logprob: float) -> list[Completion]:
        slot = self._slot[i]
        assert slot is not None
        slot.tokens.append(token)
        slot.logprobs.append(logprob)
        slot.versions.append(self.version)
        self._last[i] = token
        p = slot.request.params
        reason = None
        if token in p.stop_token_ids:
            reason = "stop"
        elif p.stop_strings and self.detokenize is not None:
            text = self.detokenize(slot.tokens)
            if any(s in text for s in p.stop_strings):
                reason = "stop"
        if reason is None and len(slot.tokens) >= p.max_tokens:
            reason = "length"
        if reason is None:
            return []
        self._release(i, slot)
        routing = np.stack(slot.routing).astype(np.int32) if slot.routing else None
        return [
            Completion(
                slot.request.id,
                list(map(int, slot.request.prompt)),
                slot.tokens,
                slot.logprobs,
                slot.versions,
                routing,
                reason,
            )
        ]


def _row(cache: KVCache, slot: jax.Array, start: jax.Array | None = None) -> KVCache:
    """Cache row `slot` as a batch-1 cache of length `start` (default 0: a prefill rewrites it from
    the start; more: it continues after the row's first `start` cached positions)."""
    return KVCache(
        {
            s: {k: jax.lax.dynamic_slice_in_dim(v, slot, 1, axis=1) for k, v in d.items()}
            for s, d in cache.layers.items()
        },
        jnp.zeros((1,), jnp.int32) if start is None else jnp.reshape(start, (1,)).astype(jnp.int32),
    )


def _put_row(cache: KVCache, row: KVCache, slot: jax.Array, n: jax.Array) -> KVCache:
    """`cache` with row `slot` replaced by the batch-1 cache `row`, its length set to n."""
    layers = {
        s: {k: jax.lax.dynamic_update_slice_in_dim(v, row.layers[s][k], slot, axis=1) for k, v in d.items()}
        for s, d in cache.layers.items()
    }
    return KVCache(layers, cache.lengths.at[slot].set(n))


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
