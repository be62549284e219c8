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
with exactly the model's sampling distribution (`inference/engine/draft_verify.py`); `spec_stats` counts
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

Parts (each testable alone): the core is this module's `Sampler` over a `SlotTable`
(`inference/engine/slot_table.py`: requests in slots, the recording of emitted tokens, completions) and the
plain programs (`inference/engine/decode_programs.py`); `PrefixCache` (`inference/engine/prefix_cache.py`)
chooses the slot a prompt takes and keeps freed slots' prefixes; `SpeculativeDecoder`
(`inference/engine/speculative_decoder.py`) holds the MTP drafts, their cache and the verify programs. Every
program is a `CountedJit` (`inference/engine/counted_jit.py`): `compilations` counts what XLA compiled.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from composer_jax.config import ConfigError, ModelConfig
from composer_jax.config.sampler import SamplerConfig
from composer_jax.inference.engine.counted_jit import use_compile_cache
from composer_jax.inference.engine.decode_programs import DecodePrograms, mesh_scope
from composer_jax.inference.engine.draft_verify import SpecStats
from composer_jax.inference.engine.prefix_cache import PrefixCache, PrefixStats
from composer_jax.inference.engine.slot_table import STOP_IDS_ON_DEVICE, Completion, Request, SlotRequest, SlotTable
from composer_jax.inference.engine.speculative_decoder import SpeculativeDecoder, checked_draft_vocab
from composer_jax.inference.engine.token_sampling import SamplingParams
from composer_jax.model.kv_cache import init_cache
from composer_jax.sharding import MeshRules, ShardingRules

__all__ = [
    "MIN_BUCKET",
    "STOP_IDS_ON_DEVICE",
    "Completion",
    "PrefixStats",
    "Request",
    "Sampler",
    "SamplerSettings",
    "bucket_of",
]

MIN_BUCKET = 16

Admission = tuple[int, Request, int]  # (slot, request, prompt tokens its cached prefix covers)


def bucket_of(n: int, cap: int) -> int:
    """The power-of-two prefill length (at least MIN_BUCKET, at most `cap`) for n tokens."""
    return min(cap, max(MIN_BUCKET, 1 << (n - 1).bit_length()))


def admission_parts(admit: list[Admission], slots: int, max_len: int) -> list[list[Admission]]:
    """The admitted requests split into prefill programs by the bucket of what each prefills:
    one program pads every row to its longest row's bucket and its rows to a power of two, so a
    30-token continuation beside a 400-token first prompt would cost a 512-token row. Parts of
    equal buckets, smallest first; a part joins the next larger one where the joined program has
    no more padded tokens (its power-of-two rows x bucket) than the two apart. `slots` is the most
    rows one program holds (the sampler's slots, or its admission_rows): a longer part is cut into
    programs of that many rows."""

    def rows(n: int) -> int:  # the rows of the programs n prompts take: full ones, then a power of two
        full, rest = divmod(n, slots)
        return full * slots + (min(slots, 1 << (rest - 1).bit_length()) if rest else 0)

    by: dict[int, list[Admission]] = {}
    for item in admit:
        by.setdefault(bucket_of(len(item[1].prompt) - item[2], max_len), []).append(item)
    parts: list[tuple[int, list[Admission]]] = []
    for bucket in sorted(by):
        part = by[bucket]
        if parts:
            b0, prev = parts[-1]
            if rows(len(prev) + len(part)) * bucket <= rows(len(prev)) * b0 + rows(len(part)) * bucket:
                parts[-1] = (bucket, prev + part)
                continue
        parts.append((bucket, part))
    return [p[i : i + slots] for _, p in parts for i in range(0, len(p), slots)]


@dataclasses.dataclass(frozen=True)
class SamplerSettings:
    """How a `Sampler` is built (everything but the weights, their version and the model config);
    a variant is `dataclasses.replace(settings, ...)`, and `Sampler.rebuilt` reuses them whole.

    slots: sequences decoded together; max_len: tokens of one sequence (prompt and output).
    mesh / rules: the device mesh the parameters are placed on and its sharding rules (None: one
    device). detokenize: ids -> text, needed only for stop strings. speculative_tokens: k > 0
    drafts k tokens per step with MTP module 1 and verifies them in one pass (needs
    model.num_mtp_layers >= 1 and the MTP parameters; the KV caches then hold max_len + 2k
    positions: a verify window and the chained drafts reach up to 2k - 1 past the last confirmed
    token). draft_vocab: token ids the drafts are restricted to (a cheaper draft head, FR-Spec;
    `inference/engine/draft_verify.py`); None = the whole vocabulary. draft_experts: routed experts per
    token in the MTP module's MoE block while drafting (0 = its shared expert only; None = the
    model's num_experts_per_tok), a cheaper draft (`draft_verify.draft_model`). None of these
    changes the output distribution. decode_chunk: decode steps (with speculation: verify steps)
    per compiled call: `step` then runs up to that many steps in one on-device loop, which ends
    early once every slot has reached its max_tokens or one of its first STOP_IDS_ON_DEVICE stop
    token ids; the host then records the tokens (stop strings and any further stop ids are checked
    there, and a request's tokens after its stop are dropped). Requests join, leave, are cancelled
    and see new weights between calls, so a larger chunk trades the granularity of continuous
    batching and streaming for fewer host round trips; the tokens are the same. prefix_cache:
    "version" (default) reuses a free slot's cached prefix computed with the current weights,
    "keep" one computed with any earlier weights too, "none" never (module docstring); speculative
    samplers ignore it (no reuse). admission_rows: the most prompts one admission program
    prefills together (its rows a power of two up to this, or up to the slots: None); each (rows,
    bucket) shape is a program compiled at first use (seconds each on a CPU), and at the tiny
    model's prefill lengths from 128 tokens a row costs the same alone as in a group of 8, so a
    cap of 1 trades little compute for a seventh of the programs."""

    slots: int
    max_len: int
    mesh: Mesh | None = None
    rules: ShardingRules | None = None
    detokenize: Callable[[list[int]], str] | None = None
    speculative_tokens: int = 0
    draft_vocab: Sequence[int] | None = None
    decode_chunk: int = 1
    prefix_cache: str = "version"
    draft_experts: int | None = None
    admission_rows: int | None = None

    def __post_init__(self) -> None:
        k = self.speculative_tokens
        if self.admission_rows is not None and self.admission_rows < 1:
            raise ConfigError(f"admission_rows={self.admission_rows} must be >= 1 (or None: up to the slots)")
        if self.decode_chunk < 1:
            raise ConfigError(f"decode_chunk={self.decode_chunk} must be >= 1 (decode steps per compiled call)")
        if k < 0:
            raise ConfigError(f"speculative_tokens={k} must be >= 0 (0 = no speculative decoding)")
        if self.draft_experts is not None and not k:
            raise ConfigError(
                f"draft_experts={self.draft_experts} needs speculative_tokens >= 1 (it sets the drafts' cost)"
            )

    def check(self, params: Any, cfg: ModelConfig) -> None:
        """Refuse settings the model cannot run, naming what would be accepted."""
        k = self.speculative_tokens
        if k and (cfg.num_mtp_layers < 1 or "mtp" not in params):
            raise ConfigError(
                f"speculative_tokens={k} drafts with the MTP modules, but the model has none "
                f"(model.num_mtp_layers={cfg.num_mtp_layers}); use speculative_tokens=0"
            )
        if self.max_len + 2 * k > cfg.max_position_embeddings:
            raise ConfigError(
                f"max_len={self.max_len} + 2 x speculative_tokens={k} exceeds model.max_position_embeddings="
                f"{cfg.max_position_embeddings}; lower max_len to at most {cfg.max_position_embeddings - 2 * k}"
            )


class Sampler:
    """Continuous-batching sampler over `settings.slots` sequences of at most `settings.max_len`
    tokens each (`SamplerSettings`). params: the model's parameters (placed on `settings.mesh` if
    given); version: the policy version they are."""

    def __init__(self, params: Any, cfg: ModelConfig, settings: SamplerSettings, *, version: int = 0):
        k = settings.speculative_tokens
        self.prefixes = PrefixCache(settings.slots, settings.prefix_cache, reuse=not k)  # raises on a bad mode
        settings.check(params, cfg)
        self.settings = settings
        self.cfg, self.slots, self.max_len, self.mesh = cfg, settings.slots, settings.max_len, settings.mesh
        self.params, self.version = params, version
        rules = settings.rules
        self.sharding = MeshRules(self.mesh, rules or ShardingRules.create()) if self.mesh is not None else None
        self.draft_vocab = checked_draft_vocab(settings.draft_vocab, cfg.vocab_size)
        self.table = SlotTable(self.slots, self.prefixes, settings.detokenize)
        self.programs = DecodePrograms(cfg, self.slots, settings.decode_chunk, self.sharding)
        self.spec: SpeculativeDecoder | None = None
        self._spec_stats = SpecStats.zeros(0)
        if k:
            self.spec = SpeculativeDecoder(
                params,
                cfg,
                k=k,
                slots=self.slots,
                cache_len=self.max_len + 2 * k,
                decode_chunk=settings.decode_chunk,
                mesh=self.mesh,
                rules=rules,
                sharding=self.sharding,
                draft_vocab=self.draft_vocab,
                draft_experts=settings.draft_experts,
            )
        self.cache = init_cache(cfg, self.slots, self.max_len + 2 * k, self.mesh, rules)
        self.prefill_s = 0.0  # seconds spent admitting requests (prefill, first token, compilations)
        self.prefill_trace_s = 0.0  # the part of prefill_s in admissions that compiled a new program
        self.warm_up_s = 0.0  # seconds `warm_up` took (not part of prefill_s)

    def rebuilt(self, params: Any, version: int) -> Sampler:
        """A fresh sampler of this one's settings holding `params` as `version` (empty slots and
        caches, counters at zero): what a driver builds after a failed step."""
        return Sampler(params, self.cfg, self.settings, version=version)

    # -------------------------------------------------------------------------------- state
    @property
    def compilations(self) -> int:
        """Programs XLA compiled (or loaded from the persistent cache) for this sampler."""
        return self.programs.compilations + (self.spec.compilations if self.spec is not None else 0)

    @property
    def prefix_stats(self) -> PrefixStats:
        return self.prefixes.stats

    @property
    def spec_stats(self) -> SpecStats:
        """Acceptance counts of the verify steps (empty for a sampler without speculation)."""
        return self.spec.stats if self.spec is not None else self._spec_stats

    @spec_stats.setter
    def spec_stats(self, stats: SpecStats) -> None:
        if self.spec is not None:
            self.spec.stats = stats
        else:
            self._spec_stats = stats

    @property
    def _slot(self) -> list[SlotRequest | None]:
        """The request in each slot (None: free)."""
        return self.table.held

    @property
    def busy(self) -> bool:
        return self.table.busy

    @property
    def slots_in_use(self) -> int:
        """Slots holding a request now."""
        return self.table.in_use()

    @property
    def waiting(self) -> int:
        """Requests submitted and not yet in a slot."""
        return len(self.table.waiting)

    @property
    def tokens_generated(self) -> int:
        """Tokens this sampler generated (every emitted token, cancelled requests' included)."""
        return self.table.generated

    # -------------------------------------------------------------------------------- API
    def submit(self, request: Request | Sequence[int], params: SamplingParams | None = None) -> str:
        """Queue a request; it joins a free slot at the next `step`. Returns its id."""
        if not isinstance(request, Request):
            request = Request(list(request), params or SamplingParams())
        if not request.id:
            request.id = self.table.new_id()
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
        if request.params.stop_strings and self.settings.detokenize is None:
            raise ValueError(f"request {request.id}: stop_strings need a sampler built with detokenize=")
        self.table.waiting.append(request)
        return request.id

    def update_weights(self, params: Any, version: int) -> None:
        """New policy weights from the next decode step on; running requests continue (their KV
        cache, computed by the earlier weights, stays) and their later tokens carry `version`."""
        self.params, self.version = params, version
        self.prefixes.new_weights()

    def running(self) -> dict[str, tuple[list[int], list[float], list[int]]]:
        """Requests in a slot -> their (tokens, logprobs, versions) generated so far: the live lists,
        for streaming servers to read between steps (do not modify them)."""
        return self.table.running()

    def cancel(self, request_id: str) -> bool:
        """Drop a waiting or running request (its slot is free from the next step on); no Completion
        is returned for it. Returns whether it was found."""
        return self.table.cancel(request_id)

    def prefill_shapes(self) -> list[tuple[int, int]]:
        """The (rows, bucket) shapes of every admission program this sampler can run: power-of-two
        groups up to `slots` (one row for speculative and mesh samplers, which admit one prompt at a
        time) by power-of-two buckets from MIN_BUCKET up to max_len (the last one max_len itself)."""
        rows, groups = 1, []
        while True:
            groups.append(min(rows, self.group_rows))
            if rows >= self.group_rows or self.settings.speculative_tokens or self.mesh is not None:
                break
            rows *= 2
        buckets = sorted({bucket_of(1 << e, self.max_len) for e in range(self.max_len.bit_length() + 1)})
        return [(g, b) for g in groups for b in buckets]

    @classmethod
    def from_config(
        cls, params: Any, cfg: ModelConfig, sampler: SamplerConfig, *, max_len: int, version: int = 0, **options: Any
    ) -> Sampler:
        """A sampler with `sampler`'s slots and prefix cache (config/sampler.py), warmed up when it
        says so and this sampler admits prompts in groups (a mesh or speculative sampler admits one
        at a time and compiles at first use). options: the other `SamplerSettings` fields."""
        if sampler.compile_cache:
            use_compile_cache(sampler.compile_cache)
        settings = SamplerSettings(
            sampler.slots,
            max_len,
            prefix_cache=sampler.prefix_cache,
            admission_rows=sampler.admission_rows,
            **{"decode_chunk": sampler.decode_chunk, **options},
        )
        new = cls(params, cfg, settings, version=version)
        if sampler.warm_up and new.admits_groups:
            new.warm_up()
        return new

    @property
    def group_rows(self) -> int:
        """The most rows one admission program prefills (settings.admission_rows, at most the slots)."""
        return min(self.slots, self.settings.admission_rows or self.slots)

    @property
    def admits_groups(self) -> bool:
        """Whether prompts are admitted in power-of-two groups (programs `warm_up` can compile)."""
        return not self.settings.speculative_tokens and self.mesh is None

    def warm_up(self) -> int:
        """Compile every admission program (`prefill_shapes`) before the first request, so no
        admission waits for a compilation (with JAX's persistent compilation cache, a later start
        loads them instead). Runs each program once on padding rows, which write nothing: the cache,
        its cached prefixes and the counters are unchanged. The decode program compiles at the first
        step as before. Only on an idle sampler; returns the programs compiled."""
        if self.busy:
            raise RuntimeError("warm_up runs before any request is submitted (the sampler is busy)")
        if not self.admits_groups:
            raise ValueError(
                "warm_up compiles the grouped admission programs of a plain sampler; this one admits one "
                f"prompt at a time (speculative_tokens={self.settings.speculative_tokens}, mesh="
                f"{'set' if self.mesh is not None else 'None'}): its programs compile at first use"
            )
        t0, before = time.perf_counter(), self.compilations
        for g, bucket in self.prefill_shapes():
            f32 = jnp.zeros(g, jnp.float32)
            self.cache, tok, *_ = self.programs.prefill_group(
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

    def step(self) -> list[Completion]:
        """Admit waiting requests into free slots (prefill), then decode one token in every
        occupied slot (or a chunk, or verify steps). Returns the requests that finished."""
        done = self._admit_waiting()
        active = self.table.active()
        if not active.any():
            return done
        if self.spec is not None:
            spec_step = self.spec.chunk_step if self.settings.decode_chunk > 1 else self.spec.step
            self.cache, more = spec_step(self.params, self.cache, self.table, self.version)
            return done + more
        if self.settings.decode_chunk > 1:
            return done + self._chunk_step(active)
        return done + self._decode_step(active)

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

    # -------------------------------------------------------------------------------- admission
    def _admit_waiting(self) -> list[Completion]:
        """Waiting requests into free slots, prefilled: in groups by bucket (`admission_parts`),
        one at a time for speculative and mesh samplers. Times it (`prefill_s`, `prefill_trace_s`)."""
        done: list[Completion] = []
        t0, compiled = time.perf_counter(), self.compilations
        admit = self.table.place()
        if self.settings.speculative_tokens or self.mesh is not None:
            for i, request, reuse in admit:
                done += self._admit(i, request, reuse)
        else:
            for part in admission_parts(admit, self.group_rows, self.max_len):
                done += self._admit_group(part)
        dt = time.perf_counter() - t0
        self.prefill_s += dt
        if self.compilations != compiled:
            self.prefill_trace_s += dt
        return done

    def _admit_group(self, admit: list[Admission]) -> list[Completion]:
        """Prefill the requests into their slots in one program: a group of a power-of-two rows
        (padding rows write nothing), each prompt's part past its reused prefix padded to the
        longest such part's bucket (a reused prefix is cut short where that bucket would run past
        the cache's end)."""
        g = min(self.group_rows, 1 << (len(admit) - 1).bit_length())
        bucket = max(bucket_of(len(r.prompt) - reuse, self.max_len) for _, r, reuse in admit)
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
            prefix_routing.append(self.prefixes.take(i, len(request.prompt), int(start[j])))
        self.cache, tok, lp, routing = self.programs.prefill_group(
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
            slot = self.table.occupy(i, request, prefix_routing[j])
            if routing_np is not None:
                slot.routing.extend(np.moveaxis(routing_np[:, j, : n[j]], 1, 0))
            done += self.table.record(i, int(tok[j]), float(lp[j]), self.version)
        return done

    def _admit(self, i: int, request: Request, reuse: int) -> list[Completion]:
        """Prefill one request into slot i (past the `reuse` prompt tokens its cached prefix covers,
        fewer where the bucket would run past the cache's end)."""
        bucket = bucket_of(len(request.prompt) - reuse, self.max_len)
        start = min(reuse, self.max_len - bucket)
        n = len(request.prompt) - start
        tokens = np.zeros((1, bucket), np.int32)
        tokens[0, :n] = request.prompt[start:]
        prefix_routing = self.prefixes.take(i, len(request.prompt), start)
        p = request.params
        args = (
            jnp.asarray(tokens),
            jnp.int32(n),
            jnp.float32(p.temperature),
            jnp.int32(p.top_k),
            jnp.float32(p.top_p),
            jnp.uint32(p.seed),
        )
        if self.spec is not None:
            self.cache, tok, lp, routing = self.spec.admit(self.params, self.cache, i, args)
        else:
            with mesh_scope(self.mesh):
                self.cache, tok, lp, routing = self.programs.prefill(
                    self.params, self.cache, jnp.int32(i), jnp.int32(start), *args
                )
        slot = self.table.occupy(i, request, prefix_routing)
        if routing is not None:
            slot.routing.extend(np.moveaxis(np.asarray(routing)[:, :n], 1, 0))
        return self.table.record(i, int(tok), float(lp), self.version)

    # -------------------------------------------------------------------------------- decoding
    def _decode_step(self, active: np.ndarray) -> list[Completion]:
        """One decode step of every occupied slot."""
        *settings, active_dev = self.table.settings()
        with mesh_scope(self.mesh):
            self.cache, tok, lp, routing = self.programs.decode(
                self.params, self.cache, jnp.asarray(self.table.last), active_dev, *settings
            )
        tok, lp = np.asarray(tok), np.asarray(lp)
        routing_np = None if routing is None else np.asarray(routing)
        done: list[Completion] = []
        for i in map(int, np.flatnonzero(active)):
            rows = None if routing_np is None else routing_np[None, :, i]
            done += self.table.emit(i, tok[i : i + 1], lp[i : i + 1], rows, self.version)
        return done

    def _chunk_step(self, active: np.ndarray) -> list[Completion]:
        """Up to `decode_chunk` decode steps in one call; each slot's tokens recorded up to its end."""
        *settings, active_dev = self.table.settings()
        remaining, stop_ids = self.table.on_device_limits(active)
        with mesh_scope(self.mesh):
            self.cache, n, tok, lp, routing = self.programs.decode_many(
                self.params,
                self.cache,
                jnp.asarray(self.table.last),
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
            rows = None if routing_np is None else routing_np[:, :, i]
            done += self.table.emit(i, tok[:, i], lp[:, i], rows, self.version)
        return done
