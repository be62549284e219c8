"""Token sampling from logits: temperature, top-k, top-p, per-request seeds; pure and jittable.

Every slot of a decode step has its own parameters (arrays over slots), so requests with
different settings share one compiled step. A token's random key is derived from its request's
seed and its position in the sequence only, so a request samples the same tokens whichever slot
it runs in and whatever else is in the batch.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled (OpenAI-style names).

    temperature: 0 is greedy. top_k: keep the k most likely tokens (0 = all). top_p: keep the
    smallest set of most likely tokens whose probability reaches top_p (1 = all). max_tokens: the
    most tokens generated. stop_token_ids / stop_strings: generation ends after a token in the first
    or once the decoded text contains one of the second (the stop string is kept, as vLLM keeps it
    with include_stop_str_in_output). seed: the request's random stream."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature={self.temperature!r} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be >= 0 (0 = no limit)")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens={self.max_tokens!r} must be a positive integer")


def _sortable(x: jax.Array) -> jax.Array:
    """float32 -> uint32 with the same order (negative floats reversed, positives above them)."""
    b = jax.lax.bitcast_convert_type(x, jnp.uint32)
    return jnp.where((b >> 31) == 1, ~b, b | jnp.uint32(0x80000000))


def _largest_threshold(keys: jax.Array, pred) -> jax.Array:
    """Per row, the largest t in [min key, max key] with pred(t) true (pred decreasing in t, true
    at the row's smallest key): a bisection over the 32-bit keys, exact in 32 halvings."""
    lo, hi = keys.min(axis=-1), keys.max(axis=-1)

    def body(_, bounds):
        lo, hi = bounds
        mid = hi - (hi - lo) // 2  # the upper middle: hi - floor((hi - lo)/2) > lo while hi > lo
        ok = pred(mid)
        return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid - 1)

    lo, hi = jax.lax.fori_loop(0, 33, body, (lo, hi))
    return lo


def processed_logprobs(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """log of the distribution tokens are drawn from: softmax(logits / T) restricted to the top-k
    and top-p set and renormalised; -inf outside it. logits: float32[S, V]; temperature, top_p:
    float32[S]; top_k: int32[S] (0 = all). A slot with temperature 0 gets the model's own
    distribution (T = 1) here: its token is the arg-max, and the log-probability reported for it
    is the model's.

    The kept set is every token at or above a per-row threshold: for top-k the k-th largest value,
    for top-p the smallest value of the shortest run of most likely tokens whose mass reaches p;
    tokens tied with the last one kept are kept too. The thresholds are found by bisection over
    the float32 bit patterns (no sort: XLA:CPU's sort of [16, 32000] took ~280 ms), and only when
    some slot filters at all."""
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    lp = jax.nn.log_softmax(logits.astype(jnp.float32) / t, axis=-1)

    def filtered(lp: jax.Array) -> jax.Array:
        v = lp.shape[-1]
        keys = _sortable(lp)
        probs = jnp.exp(lp)
        k = jnp.where(top_k > 0, jnp.minimum(top_k, v), v)
        thr_k = _largest_threshold(keys, lambda th: (keys >= th[:, None]).sum(-1) >= k)
        thr_p = _largest_threshold(keys, lambda th: jnp.where(keys >= th[:, None], probs, 0.0).sum(-1) >= top_p)
        # p = 1 keeps everything (a float32 sum of the whole distribution may round to 1 before
        # its smallest terms are added, which would drop them)
        thr_p = jnp.where(top_p >= 1.0, keys.min(axis=-1), thr_p)
        kept = jnp.where(keys >= jnp.maximum(thr_k, thr_p)[:, None], lp, -jnp.inf)
        return kept - jax.nn.logsumexp(kept, axis=-1, keepdims=True)

    return jax.lax.cond(jnp.any(top_k > 0) | jnp.any(top_p < 1.0), filtered, lambda x: x, lp)


def token_keys(seeds: jax.Array, positions: jax.Array) -> jax.Array:
    """One PRNG key per slot from (request seed, position of the token in its sequence)."""
    return jax.vmap(lambda s, p: jax.random.fold_in(jax.random.key(s), p))(seeds, positions)


def sample(
    logits: jax.Array,
    temperature: jax.Array,
    top_k: jax.Array,
    top_p: jax.Array,
    seeds: jax.Array,
    positions: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """-> (tokens int32[S], log-probabilities float32[S] of those tokens under the sampling
    distribution). Greedy (T = 0) slots take the arg-max; the others invert the distribution's
    CDF at one uniform number per slot (one random draw per token, not one per vocabulary entry)."""
    lp = processed_logprobs(logits, temperature, top_k, top_p)
    tokens = draw(lp, temperature, token_uniforms(seeds, positions))
    return tokens, jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]


def token_uniforms(seeds: jax.Array, positions: jax.Array, stream: int = 0) -> jax.Array:
    """float32[S] in (0, 1], one per slot, from (seed, position, stream). Stream 0 is the draw of
    the token itself (what `sample` uses); speculative decoding takes its accept test and residual
    draw from streams 1 and 2 of the same (seed, position)."""
    keys = token_keys(seeds, positions)
    if stream:
        keys = jax.vmap(lambda k: jax.random.fold_in(k, stream))(keys)
    return 1.0 - jax.vmap(jax.random.uniform)(keys)  # (0, 1]: never picks p = 0


def inverse_cdf(probs: jax.Array, u: jax.Array) -> jax.Array:
    """int32[S]: per row, the first index whose cumulative (unnormalised) mass reaches u times the
    row's total; probs: float32[S, V] >= 0, u: (0, 1]. An entry of zero mass is never picked.

    A bisection over the index, not a cumulative sum: the mass up to index m is one masked sum per
    row, so each of the ceil(log2 V) halvings is elementwise work and a reduction, which shards over
    the vocabulary as it is (an all-reduce of S numbers). `jnp.cumsum` over a vocabulary-sharded
    axis is left by XLA as a reduce-window as wide as the vocabulary: O(V^2), 8.6 s for [4, 129280]
    over two devices against 0.025 s on one. Every halving evaluates the same reduction, so the mass
    is non-decreasing in m (float addition is monotone in each term) and equal at m - 1 and m when
    entry m has no mass: the answer is never a zero-mass entry. The search ends at the last entry
    with mass at the latest, should rounding leave the whole row's masked sum under the target."""
    v = probs.shape[-1]
    idx = jnp.arange(v, dtype=jnp.int32)
    last = jnp.max(jnp.where(probs > 0, idx, 0), axis=-1)

    def mass_through(m: jax.Array) -> jax.Array:
        return jnp.where(idx <= m[:, None], probs, 0.0).sum(-1)

    target = u * probs.sum(-1)

    def body(_, bounds):
        lo, hi = bounds
        mid = lo + (hi - lo) // 2
        ok = (mass_through(mid) >= target) | (mid >= last)
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    lo, _ = jax.lax.fori_loop(0, max(1, (v - 1).bit_length()), body, (jnp.zeros_like(last), last))
    return lo


def argmax_first(x: jax.Array) -> jax.Array:
    """int32[...]: per row of x [..., V] the first index of the largest value (`jnp.argmax`'s answer
    for rows without NaN) as a max and a min reduction: XLA:CPU's variadic arg-max reduce took
    ~3x as long over [16, 32000] (1.25 vs 0.37 ms)."""
    v = x.shape[-1]
    first = jnp.where(x == x.max(-1, keepdims=True), jnp.arange(v, dtype=jnp.int32), v)
    return jnp.minimum(first.min(-1), v - 1)


def sampled_or_greedy(temperature: jax.Array, greedy: jax.Array, sampled) -> jax.Array:
    """greedy where temperature == 0, sampled() elsewhere; sampled() (the inverse CDF's bisection,
    a few ms for [16, 32000] on XLA:CPU) runs only when some slot samples."""
    return jax.lax.cond(jnp.any(temperature > 0), lambda: jnp.where(temperature > 0, sampled(), greedy), lambda: greedy)


def draw(lp: jax.Array, temperature: jax.Array, u: jax.Array) -> jax.Array:
    """Tokens int32[S] from processed log-probabilities lp [S, V]: the arg-max for greedy (T = 0)
    slots, the inverse CDF at u for the others."""
    return sampled_or_greedy(temperature, argmax_first(lp), lambda: inverse_cdf(jnp.exp(lp), u))
