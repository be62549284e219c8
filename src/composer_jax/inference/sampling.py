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


def processed_logprobs(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """log of the distribution tokens are drawn from: softmax(logits / T) restricted to the top-k
    and top-p set and renormalised; -inf outside it. logits: float32[S, V]; temperature, top_p:
    float32[S]; top_k: int32[S] (0 = all). A slot with temperature 0 gets the model's own
    distribution (T = 1) here: its token is the arg-max, and the log-probability reported for it
    is the model's."""
    t = jnp.where(temperature > 0, temperature, 1.0)[:, None]
    lp = jax.nn.log_softmax(logits.astype(jnp.float32) / t, axis=-1)
    order = jnp.argsort(-lp, axis=-1)  # most likely first (ties: lower id first)
    sorted_lp = jnp.take_along_axis(lp, order, axis=-1)
    rank = jnp.arange(lp.shape[-1])[None, :]
    keep_k = (top_k[:, None] <= 0) | (rank < top_k[:, None])
    # top-p: keep a token if the mass of the tokens before it is still below p (the first always)
    before = jnp.cumsum(jnp.exp(sorted_lp), axis=-1) - jnp.exp(sorted_lp)
    keep_p = before < top_p[:, None]
    keep_sorted = keep_k & keep_p
    keep = jnp.zeros_like(keep_sorted).at[jnp.arange(lp.shape[0])[:, None], order].set(keep_sorted)
    kept = jnp.where(keep, lp, -jnp.inf)
    return kept - jax.nn.logsumexp(kept, axis=-1, keepdims=True)


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
    distribution). Greedy (T = 0) slots take the arg-max."""
    lp = processed_logprobs(logits, temperature, top_k, top_p)
    keys = token_keys(seeds, positions)
    drawn = jax.vmap(lambda k, row: jax.random.categorical(k, row))(keys, lp)
    tokens = jnp.where(temperature > 0, drawn, jnp.argmax(lp, axis=-1)).astype(jnp.int32)
    return tokens, jnp.take_along_axis(lp, tokens[:, None], axis=-1)[:, 0]
