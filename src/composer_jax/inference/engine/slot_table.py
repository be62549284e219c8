"""The sampler core's host state: requests waiting, the request in each slot, its tokens so far.

`SlotTable` is what every step mode shares: it places waiting requests into free slots (through the
`PrefixCache`), records the tokens a program emitted for a slot in order until the request ends (a
stop token id, a stop string, max_tokens), frees the slot and builds the `Completion`, and keeps the
per-slot sampling settings that every step sends to the device. No compiled program here.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from composer_jax.inference.engine.prefix_cache import PrefixCache
from composer_jax.inference.engine.token_sampling import SamplingParams

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
class SlotRequest:
    """A request in a slot and what it generated so far."""

    request: Request
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    routing: list[np.ndarray] = dataclasses.field(default_factory=list)
    weights: int = 0  # the prefix cache's weight generation when admitted (its prefix and prefill's)


class SlotTable:
    """`slots` slots; `prefixes` chooses the slot each request takes and keeps what a freed slot
    leaves; detokenize: ids -> text, for stop strings."""

    def __init__(self, slots: int, prefixes: PrefixCache, detokenize: Callable[[list[int]], str] | None = None):
        self.slots, self.prefixes, self.detokenize = slots, prefixes, detokenize
        self.held: list[SlotRequest | None] = [None] * slots
        self.waiting: collections.deque[Request] = collections.deque()
        self.last = np.zeros(slots, np.int32)  # each slot's last token: the next decode step's input
        self._ids = itertools.count()
        self._settings: tuple[jax.Array, ...] | None = None  # on the device; rebuilt when slots change
        self.generated = 0  # tokens recorded over the table's life (serve's /metrics reads it)

    @property
    def busy(self) -> bool:
        return bool(self.waiting) or any(s is not None for s in self.held)

    def new_id(self) -> str:
        return f"req-{next(self._ids)}"

    def in_use(self) -> int:
        """Slots holding a request."""
        return sum(s is not None for s in self.held)

    def active(self) -> np.ndarray:
        """bool[slots]: the occupied slots."""
        return np.array([s is not None for s in self.held])

    def place(self) -> list[tuple[int, Request, int]]:
        """Waiting requests into free slots, first come first served, each into the free slot the
        prefix cache picks. -> (slot, request, prompt tokens its cached prefix covers)."""
        free = [i for i in range(self.slots) if self.held[i] is None]
        out: list[tuple[int, Request, int]] = []
        while free and self.waiting:
            request = self.waiting.popleft()
            best, reuse = self.prefixes.best_slot(free, request.prompt)
            free.remove(best)
            out.append((best, request, reuse))
        return out

    def occupy(self, i: int, request: Request, routing: list[np.ndarray]) -> SlotRequest:
        """Slot i now holds `request` (its reused prefix's routing so far)."""
        slot = SlotRequest(request, routing=routing, weights=self.prefixes.generation)
        self.held[i] = slot
        self._settings = None
        return slot

    def release(self, i: int) -> None:
        """Slot i's request left (finished or cancelled): the slot is free; its cache row holds the
        KV of the prompt and of every generated token but the last (never forwarded)."""
        slot = self.held[i]
        assert slot is not None
        self.held[i] = None
        self._settings = None
        self.prefixes.release(i, [*slot.request.prompt, *slot.tokens[:-1]], slot.routing, slot.weights)

    def record(self, i: int, token: int, logprob: float, version: int) -> list[Completion]:
        """One token of slot i; -> its Completion if that ended the request."""
        slot = self.held[i]
        assert slot is not None
        slot.tokens.append(token)
        slot.logprobs.append(logprob)
        slot.versions.append(version)
        self.last[i] = token
        self.generated += 1
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
        self.release(i)
        routing = np.stack(slot.routing).astype(np.int32) if slot.routing else None
        prompt = list(map(int, slot.request.prompt))
        return [Completion(slot.request.id, prompt, slot.tokens, slot.logprobs, slot.versions, routing, reason)]

    def emit(
        self, i: int, tokens: np.ndarray, logprobs: np.ndarray, routing: np.ndarray | None, version: int
    ) -> list[Completion]:
        """Slot i's tokens in order until its request ends (the rest is dropped); routing[t] (the
        experts of the input token before tokens[t]) is recorded with each, None for dense models."""
        done: list[Completion] = []
        for t in range(len(tokens)):
            slot = self.held[i]
            if slot is None:  # finished at an earlier token
                break
            if routing is not None:
                slot.routing.append(routing[t])
            done += self.record(i, int(tokens[t]), float(logprobs[t]), version)
        return done

    def settings(self) -> tuple[jax.Array, ...]:
        """Per-slot (temperature, top_k, top_p, seed, occupied) on the device (idle slots: defaults)."""
        if self._settings is None:
            reqs = [s.request.params if s is not None else SamplingParams() for s in self.held]
            self._settings = (
                jnp.asarray([p.temperature for p in reqs], jnp.float32),
                jnp.asarray([p.top_k for p in reqs], jnp.int32),
                jnp.asarray([p.top_p for p in reqs], jnp.float32),
                jnp.asarray([p.seed for p in reqs], jnp.uint32),
                jnp.asarray([p is not None for p in self.held]),
            )
        return self._settings

    def on_device_limits(self, active: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(tokens each slot may still make int32[S], its first stop ids int32[S, STOP_IDS_ON_DEVICE],
        -1 = none) for the on-device checks of a chunk."""
        remaining = np.zeros(self.slots, np.int32)
        stop_ids = np.full((self.slots, STOP_IDS_ON_DEVICE), -1, np.int32)
        for i in map(int, np.flatnonzero(active)):
            slot = self.held[i]
            assert slot is not None
            remaining[i] = slot.request.params.max_tokens - len(slot.tokens)
            ids = slot.request.params.stop_token_ids[:STOP_IDS_ON_DEVICE]
            stop_ids[i, : len(ids)] = ids
        return remaining, stop_ids

    def running(self) -> dict[str, tuple[list[int], list[float], list[int]]]:
        """Requests in a slot -> their (tokens, logprobs, versions) generated so far (live lists)."""
        return {s.request.id: (s.tokens, s.logprobs, s.versions) for s in self.held if s is not None}

    def cancel(self, request_id: str) -> bool:
        """Drop a waiting or running request; returns whether it was found."""
        for r in self.waiting:
            if r.id == request_id:
                self.waiting.remove(r)
                return True
        for i, s in enumerate(self.held):
            if s is not None and s.request.id == request_id:
                self.release(i)
                return True
        return False
