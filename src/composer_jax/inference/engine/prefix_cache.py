"""Which free slot a prompt takes, and what its cache row already holds (host bookkeeping, no JAX).

When a request leaves its slot, the slot's KV cache row (the prompt and every generated token but
the last, which no forward has seen) stays valid as a cached prefix until the slot is reused. A new
request takes the free slot whose cached tokens share the longest prefix with its prompt (none or a
tie: the least recently used one) and is prefilled past the tokens it shares. Modes (`PREFIX_CACHE_MODES`):
"version" drops the cached prefixes when the weights change (a prompt's KV is always the current
weights'), "keep" keeps them across versions, "none" never reuses (the least-recently-used choice of
a free slot still applies). The device side (prefilling at a per-row start) is the sampler's.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

import numpy as np

from composer_jax.config.sampler import PREFIX_CACHE_MODES
from composer_jax.errors import ConfigError


@dataclasses.dataclass
class CachedPrefix:
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

    def __add__(self, other: PrefixStats) -> PrefixStats:
        return PrefixStats(
            self.admitted + other.admitted,
            self.hits + other.hits,
            self.reused + other.reused,
            self.prefilled + other.prefilled,
        )


class PrefixCache:
    """The cached prefixes of `slots` cache rows under `mode`; `reuse=False` (speculative samplers,
    whose idle verify windows overwrite free rows) caches nothing whatever the mode."""

    def __init__(self, slots: int, mode: str = "version", *, reuse: bool = True):
        if mode not in PREFIX_CACHE_MODES:
            raise ConfigError(f"prefix_cache={mode!r} is not accepted; accepted: {', '.join(PREFIX_CACHE_MODES)}")
        self.slots, self.mode = slots, mode
        self.reuse = reuse and mode != "none"
        self.prefixes: list[CachedPrefix | None] = [None] * slots
        self.used_at = [-1] * slots  # when each slot was last taken or left (least recently used first)
        self._clock = itertools.count()
        self.generation = 0  # bumped by every weight change
        self.stats = PrefixStats()

    def match(self, i: int, prompt: np.ndarray) -> int:
        """Leading prompt tokens slot i's cached prefix holds (at most all but the last prompt
        token: a prefill needs one token to compute the next one's distribution)."""
        prefix = self.prefixes[i]
        if prefix is None:
            return 0
        k = min(len(prefix.tokens), len(prompt) - 1)
        same = prefix.tokens[:k] == prompt[:k]
        return k if same.all() else int(np.argmin(same))

    def best_slot(self, free: Sequence[int], prompt: Sequence[int]) -> tuple[int, int]:
        """The free slot `prompt` takes: the longest match, then the least recently used. -> (slot,
        prompt tokens its cached prefix covers)."""
        tokens = np.asarray(prompt, np.int32)
        best = max(free, key=lambda i: (self.match(i, tokens), -self.used_at[i]))
        return best, self.match(best, tokens)

    def take(self, i: int, prompt_len: int, reuse: int) -> list[np.ndarray]:
        """Slot i is taken by a prompt of `prompt_len` tokens, `reuse` of which its cached prefix
        covers: count it and return the routing of those tokens (the row is the new request's now)."""
        prefix, self.prefixes[i] = self.prefixes[i], None
        self.used_at[i] = next(self._clock)
        st = self.stats
        st.admitted, st.hits = st.admitted + 1, st.hits + (reuse > 0)
        st.reused, st.prefilled = st.reused + reuse, st.prefilled + prompt_len - reuse
        return [] if prefix is None or not reuse else prefix.routing[:reuse]

    def release(self, i: int, tokens: Sequence[int], routing: list[np.ndarray], generation: int) -> None:
        """Slot i's request left; its row holds the KV of `tokens` (the prompt and every generated
        token but the last), computed from weights of `generation` on (its admission's): a prefix
        later requests may reuse if those are the current weights (or mode "keep")."""
        self.used_at[i] = next(self._clock)
        if self.reuse and (self.mode == "keep" or generation == self.generation):
            self.prefixes[i] = CachedPrefix(np.asarray(tokens, np.int32), routing)

    def new_weights(self) -> None:
        """The weights changed: under "version" the cached prefixes are another version's, dropped."""
        self.generation += 1
        if self.mode != "keep":
            self.prefixes = [None] * self.slots
