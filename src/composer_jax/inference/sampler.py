"""The rollout sampler: a fixed number of KV-cache slots with continuous batching.

Requests of any prompt and output length join free slots and leave when done, between decode
steps; every decode step advances all occupied slots by one token with one compiled program
(static shapes: [slots, 1] tokens over a [slots, max_len] cache). A prompt is prefilled into its
slot alone, padded to a power-of-two bucket, so a run compiles the decode step once and the prefill
once per bucket it meets (`Sampler.compilations` counts them).

For every generated token the sampler records its log-probability under the sampling distribution,
the policy version of the weights that produced it, and for MoE models the experts it was routed to
in every layer (`routing`, the trainer's `routing=` replay input; prompt tokens' routing too).
`update_weights` swaps the parameters between two decode steps: running requests keep their KV
cache and continue under the new weights, and their later tokens carry the new version (PipelineRL's
in-flight weight update).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from composer_jax.config import ModelConfig
from composer_jax.inference.sampling import SamplingParams, sample
from composer_jax.model.kv_cache import KVCache, init_cache
from composer_jax.model.transformer import forward
from composer_jax.sharding import MeshRules, ShardingRules

MIN_BUCKET = 16


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


def _bucket(n: int, cap: int) -> int:
    return min(cap, max(MIN_BUCKET, 1 << (n - 1).bit_length()))


class Sampler:
    """Continuous-batching sampler over `slots` sequences of at most `max_len` tokens each.

    params: the model's parameters (placed on `mesh` if given); version: the policy version they
    are. detokenize: ids -> text, needed only for stop strings."""

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
    ):
        self.cfg, self.slots, self.max_len = cfg, slots, max_len
        self.params, self.version = params, version
        self.mesh = mesh
        self.sharding = MeshRules(mesh, rules or ShardingRules.create()) if mesh is not None else None
        self.detokenize = detokenize
        self.cache = init_cache(cfg, slots, max_len, mesh, rules)
        self._slot: list[_Slot | None] = [None] * slots
        self._waiting: collections.deque[Request] = collections.deque()
        self._ids = itertools.count()
        self.compilations = 0
        self._prefill = jax.jit(self._prefill_fn, donate_argnums=(1,))
        self._decode = jax.jit(self._decode_fn, donate_argnums=(1,))
        # per-slot sampling settings and state, on the host; sent with every step
        self._last = np.zeros(slots, np.int32)
        self._settings_cache: tuple | None = None  # per-slot settings on the device; rebuilt when slots change

    # -------------------------------------------------------------------------------- programs
    def _prefill_fn(self, params, cache: KVCache, slot, tokens, n, temperature, top_k, top_p, seed):
        """Prompt tokens int32[1, bucket] (n real) into cache row `slot`; -> (cache, first token,
        its log-prob, routing of the prompt tokens [moe_layers, bucket, k] or None)."""
        self.compilations += 1  # runs once per trace: a new bucket size
        row = KVCache(
            {
                s: {k: jax.lax.dynamic_slice_in_dim(v, slot, 1, axis=1) for k, v in d.items()}
                for s, d in cache.layers.items()
            },
            jnp.zeros((1,), jnp.int32),
        )
        out = forward(params, tokens, self.cfg, cache=row, sharding=self.sharding)
        assert out.cache is not None
        layers = {
            s: {k: jax.lax.dynamic_update_slice_in_dim(v, out.cache.layers[s][k], slot, axis=1) for k, v in d.items()}
            for s, d in cache.layers.items()
        }
        cache = KVCache(layers, cache.lengths.at[slot].set(n))
        logits = jax.lax.dynamic_index_in_dim(out.logits[0], n - 1, axis=0)  # [1, V]
        tok, lp = sample(logits, temperature[None], top_k[None], top_p[None], seed[None], n[None])
        routing = None if out.routing is None else out.routing[:, 0]
        return cache, tok[0], lp[0], routing

    def _decode_fn(self, params, cache: KVCache, tokens, active, temperature, top_k, top_p, seeds):
        """One token for every slot: tokens int32[S] (each slot's last token) -> (cache, next
        tokens, their log-probs, routing of the input tokens [moe_layers, S, k] or None)."""
        self.compilations += 1
        out = forward(params, tokens[:, None], self.cfg, cache=cache, sharding=self.sharding)
        assert out.cache is not None
        # idle slots stay where they are (their writes land past their length and are never seen)
        lengths = jnp.where(active, out.cache.lengths, cache.lengths)
        new_cache = KVCache(out.cache.layers, lengths)
        tok, lp = sample(out.logits[:, 0], temperature, top_k, top_p, seeds, lengths)
        routing = None if out.routing is None else out.routing[:, :, 0]
        return new_cache, tok, lp, routing

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
                self._slot[i] = None
                self._settings_cache = None
                return True
        return False

    @property
    def busy(self) -> bool:
        return bool(self._waiting) or any(s is not None for s in self._slot)

    def step(self) -> list[Completion]:
        """Admit waiting requests into free slots (prefill), then decode one token in every
        occupied slot. Returns the requests that finished."""
        done: list[Completion] = []
        for i in range(self.slots):
            if self._slot[i] is None and self._waiting:
                done += self._admit(i, self._waiting.popleft())
        active = np.array([s is not None for s in self._slot])
        if not active.any():
            return done
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

    def _admit(self, i: int, request: Request) -> list[Completion]:
        n = len(request.prompt)
        bucket = _bucket(n, self.max_len)
        tokens = np.zeros((1, bucket), np.int32)
        tokens[0, :n] = request.prompt
        p = request.params
        ctx = jax.set_mesh(self.mesh) if self.mesh is not None else _null()
        with ctx:
            self.cache, tok, lp, routing = self._prefill(
                self.params,
                self.cache,
                jnp.int32(i),
                jnp.asarray(tokens),
                jnp.int32(n),
                jnp.float32(p.temperature),
                jnp.int32(p.top_k),
                jnp.float32(p.top_p),
                jnp.uint32(p.seed),
            )
        slot = _Slot(request)
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
        self._slot[i] = None
        self._settings_cache = None
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


class _null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None
