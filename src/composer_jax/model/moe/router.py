"""The MoE router: which experts each token goes to, with what gate weight, and the load statistics
that balance them (DeepSeek-V2/V3, Kimi K2, Qwen3-MoE).

  scores = sigmoid(x W_r) or softmax(x W_r)                          (float32)
  selection: greedy top-k; or group-limited: keep the `topk_group` best of `n_group` expert groups
  (V2: group score = max; V3 "noaux_tc": sum of the top-2 of scores + bias), then top-k inside them.
  The score-correction bias is used for selection only; gate weights are the unbiased scores,
  optionally renormalised over the top-k, times routed_scaling_factor.

Router replay hands `route` recorded experts instead of its own selection. The balance terms:
per-expert assignment counts (the aux-loss-free bias update of DeepSeek-V3) and the complementary
sequence-wise balance loss.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from einops import rearrange, repeat

from composer_jax.config import ModelConfig


class Routing(NamedTuple):
    weights: jax.Array  # float32[tokens, k]
    experts: jax.Array  # int32[tokens, k]
    scores: jax.Array  # float32[tokens, experts] (sigmoid or softmax, before selection)


def route(
    router_w: jax.Array, router_bias: jax.Array, x: jax.Array, cfg: ModelConfig, routing: jax.Array | None = None
) -> Routing:
    """x: [tokens, embed] -> Routing. `routing` (int32[tokens, k], recorded experts) replaces the
    selection (router replay): those experts are used, with gate weights from the current router."""
    logits = x.astype(jnp.float32) @ router_w.astype(jnp.float32)
    if cfg.score_func == "sigmoid":
        scores = jax.nn.sigmoid(logits)
    else:
        scores = jax.nn.softmax(logits, axis=-1)
    k, e = cfg.num_experts_per_tok, cfg.num_experts
    if routing is not None:
        experts = routing.astype(jnp.int32)
    else:
        choice = scores + router_bias.astype(jnp.float32) if cfg.topk_method == "noaux_tc" else scores
        if cfg.topk_method != "greedy" and cfg.n_group > 1:
            grouped = rearrange(choice, "t (group e) -> t group e", group=cfg.n_group)
            if cfg.topk_method == "noaux_tc":
                group_score = jax.lax.top_k(grouped, 2)[0].sum(-1)
            else:
                group_score = grouped.max(-1)
            _, top_groups = jax.lax.top_k(group_score, cfg.topk_group)
            keep = (
                jnp.zeros(group_score.shape, bool).at[jnp.arange(group_score.shape[0])[:, None], top_groups].set(True)
            )
            choice = jnp.where(repeat(keep, "t group -> t (group e)", e=e // cfg.n_group), choice, -jnp.inf)
        _, experts = jax.lax.top_k(choice, k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
    return Routing(weights * cfg.routed_scaling_factor, experts, scores)


def expert_counts(experts: jax.Array, num_experts: int) -> jax.Array:
    """int32[tokens, k] -> float32[num_experts] number of assignments per expert."""
    return jnp.zeros((num_experts,), jnp.float32).at[experts.reshape(-1)].add(1.0)


def router_bias_update(bias: jax.Array, counts: jax.Array, rate: float) -> jax.Array:
    """Aux-loss-free balancing (DeepSeek-V3 sec. 2.1.2): b_e += u * sign(mean load - load_e).

    bias, counts: float32[..., experts] (a leading layers axis is fine)."""
    mean = counts.mean(-1, keepdims=True)
    return bias + rate * jnp.sign(mean - counts)


def sequence_balance(scores: jax.Array, experts: jax.Array, num_experts: int, seq_axes=(), seq_shards: int = 1):
    """DeepSeek-V3's complementary sequence-wise balance loss, summed over the rows of the block.

    scores: float32[batch, seq, experts]; experts: int32[batch, seq, k]. Per sequence,
    f_i = E / (k S) * #{tokens choosing i}, P_i = mean_t s_it / sum_j s_jt, loss = sum_i f_i P_i
    (1 when balanced and scores uniform). With the sequence split over `seq_axes`, the per-row
    sums are all-reduced first.
    """
    b, s, k = experts.shape
    chosen = jnp.zeros((b, num_experts), jnp.float32).at[jnp.arange(b)[:, None], experts.reshape(b, s * k)].add(1.0)
    p_sum = (scores / scores.sum(-1, keepdims=True)).sum(1)
    if seq_axes:
        chosen, p_sum = jax.lax.psum((chosen, p_sum), seq_axes)
    seq = s * seq_shards
    f = chosen * num_experts / (k * seq)
    return jnp.sum(f * p_sum / seq)
