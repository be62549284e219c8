"""The RL objective: Dr. GRPO policy gradient against the sampler's recorded log-probabilities,
with optional PPO clipping, k1 KL to a frozen reference policy, an importance-ratio correction
(plausibility band, truncated or masked importance sampling) and MoE router replay. An
`Objective` (`train/objective.py`): the train step micro-batches, shards and accumulates it
exactly as it does pretraining.

Per policy token t of a rollout with advantage A (docs/rl.md has the derivation):

    r_t    = exp(log pi(t) - log mu(t))                  pi: trainer, mu: sampler (recorded)
    keep_t = loss_mask_t * K(sg(r_t))                    the importance correction's mask
    q_t    = r_t * sg(T(r_t) / r_t)                      its value T(r_t), its gradient T(r_t) grad log pi
    pg_t   = min(q_t A, clip(q_t, 1 - eps_low, 1 + eps_high) A)     (no clipping: q_t A)
    kl_t   = sg(log pi(t) - log pi_ref(t)) q_t          k1, as a penalty on the sampled token
    loss   = sum_t w_t keep_t (-pg_t + beta kl_t) / D

with (K, T) from the importance registry (`rl.loss.importance`): none (K = 1, T(r) = r), band
(K = [lo <= r <= hi], the plausibility band), tis (K = 1, T(r) = min(r, C): truncated importance
sampling) and icepop (K = [1/C <= r <= C]: masked importance sampling). pi here is the trainer's
forward of the current parameters, which is also what the trainer's pi_old would be (each batch is
trained by one step), so r is pi_old / mu of the TIS / IcePop papers: the sampler/trainer mismatch
and the staleness of the sampler's version together (docs/rl.md).

with (w, D) from the aggregation registry: token_sum (w = mask, D = a constant), token_mean
(D = policy tokens in the batch), sequence_mean (w = mask / tokens of its sequence, D =
sequences). D is a whole-batch number computed in `prepare`, so micro-batches add up exactly.

Why k1 enters through sg(k1) r_t: the gradient of KL(pi || pi_ref) is E_pi[(log pi - log pi_ref)
grad log pi], i.e. k1 acting as a per-token negative reward; adding k1 itself to the loss would
give E_pi[grad log pi] = 0 in expectation. At r = 1 the term's value is beta times the k1
estimate, so the logged loss still reads as one.

Batch (every array [batch, seq, ...], values aligned with `tokens`: index i describes token i):
    tokens int32, segment_ids int32 (0 = padding), positions int32, loss_mask float32 (1 = a
    policy-generated token), advantages float32 (its rollout's advantage), sampler_logprobs
    float32 (log mu of token i, as the sampler recorded it), ref_logprobs float32 (log pi_ref of
    token i; `reference_logprobs`; only when rl.loss.kl_coef > 0), routing int32[batch, seq,
    moe_layers, k] (the sampler's experts of token i; only with rl.loss.router_replay on a MoE
    model). `rl/algo/batch.py` builds it from rollouts.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from einops import rearrange

from composer_jax.config import Config
from composer_jax.config.rl import RLLossConfig, importance_correction
from composer_jax.model.context_parallel import context_size, zigzag_permutation
from composer_jax.model.layers import linear
from composer_jax.model.transformer import output_head
from composer_jax.sharding import MeshRules
from composer_jax.train.objective import Objective
from composer_jax.train.pretrain import ce_chunks, forward_microbatch, moe_exchange_sums

BASE_KEYS = ("tokens", "segment_ids", "positions", "loss_mask", "advantages", "sampler_logprobs")
# The recorded routing from `prepare` on: [moe_layers, batch, seq, k], what `forward(routing=)`
# takes and its layer scan slices (the batch's [batch, seq, moe_layers, k] moved once, in `prepare`)
ROUTING_AXES: tuple[str | None, ...] = (None, "act_batch", "act_seq", None)
# |log r| above this is clamped in the ratio and k3 metrics only (exp would overflow float32 at 88
# and one such token would make the step skip its update for a logged number)
_METRIC_LOG_RATIO_CAP = 20.0

# --------------------------------------------------------------------------------------------------
# Aggregation registry: per-token weights and the whole-batch denominator
# --------------------------------------------------------------------------------------------------

Aggregation = Callable[[jax.Array, float], tuple[jax.Array, jax.Array]]
AGGREGATIONS: dict[str, Aggregation] = {}


def register_aggregation(name: str) -> Callable[[Aggregation], Aggregation]:
    """Decorator: register `fn(mask float32[batch, seq], normalizer) -> (weights float32[batch,
    seq], denominator float32[])` as `name`. The loss is sum(weights * per-token loss) / denominator."""

    def register(fn: Aggregation) -> Aggregation:
        if name in AGGREGATIONS:
            raise ValueError(f"aggregation {name!r} is already registered")
        AGGREGATIONS[name] = fn
        return fn

    return register


@register_aggregation("token_sum")
def token_sum(mask: jax.Array, normalizer: float) -> tuple[jax.Array, jax.Array]:
    """Dr. GRPO: sum over tokens divided by a constant (default rows x seq_len of the batch), so a
    sequence's weight does not shrink with its length and no step's scale depends on its lengths."""
    constant = normalizer if normalizer > 0 else float(np.prod(mask.shape))
    return mask, jnp.asarray(constant, jnp.float32)


@register_aggregation("token_mean")
def token_mean(mask: jax.Array, normalizer: float) -> tuple[jax.Array, jax.Array]:
    """DAPO: sum over tokens divided by the batch's policy tokens (before plausibility filtering)."""
    return mask, jnp.maximum(mask.sum(), 1.0)


@register_aggregation("sequence_mean")
def sequence_mean(mask: jax.Array, normalizer: float) -> tuple[jax.Array, jax.Array]:
    """Original GRPO: each sequence's token mean, averaged over the sequences with policy tokens."""
    per_row = mask.sum(axis=-1, keepdims=True)
    return mask / jnp.maximum(per_row, 1.0), jnp.maximum((per_row > 0).sum(), 1).astype(jnp.float32)


# --------------------------------------------------------------------------------------------------
# Importance registry: how the trainer/sampler ratio is corrected
# --------------------------------------------------------------------------------------------------

# fn(log r float32[...] (no gradient), policy-token mask bool[...], cfg) -> (keep bool[...], log T(r)
# float32[...] (no gradient; read only where keep), metric sums {name: float32[]})
ImportanceCorrection = Callable[[jax.Array, jax.Array, RLLossConfig], tuple[jax.Array, jax.Array, dict[str, jax.Array]]]
IMPORTANCE_CORRECTIONS: dict[str, ImportanceCorrection] = {}


def register_importance(name: str) -> Callable[[ImportanceCorrection], ImportanceCorrection]:
    """Decorator: register `fn(log_ratio, on, cfg) -> (keep, log_weight, metric sums)` as `name`:
    the tokens that keep a loss (a subset of `on`), the log of the ratio's value on them (the
    gradient stays d log pi times that value) and the correction's own metric sums."""

    def register(fn: ImportanceCorrection) -> ImportanceCorrection:
        if name in IMPORTANCE_CORRECTIONS:
            raise ValueError(f"importance correction {name!r} is already registered")
        IMPORTANCE_CORRECTIONS[name] = fn
        return fn

    return register


@register_importance("none")
def no_correction(lr: jax.Array, on: jax.Array, cfg: RLLossConfig):
    """The plain ratio on every policy token."""
    return on, lr, {}


def _within(lr: jax.Array, lo: float, hi: float) -> jax.Array:
    """lo <= exp(lr) <= hi, compared in log space (lo = 0: no lower bound)."""
    return (lr >= np.log(lo) if lo > 0 else True) & (lr <= np.log(hi))


@register_importance("band")
def plausibility_band(lr: jax.Array, on: jax.Array, cfg: RLLossConfig):
    """The plausibility band [lo, hi]: tokens whose ratio lies outside get no loss (the stacks disagree
    too much on them for the sample to say anything); filtered_fraction reports them."""
    assert cfg.plausibility_band is not None  # validate_rl_loss: band needs it
    lo, hi = cfg.plausibility_band
    return on & _within(lr, lo, hi), lr, {}


@register_importance("tis")
def truncated_importance(lr: jax.Array, on: jax.Array, cfg: RLLossConfig):
    """Truncated importance sampling: every policy token keeps its loss with weight min(r, C) (C =
    importance_cap), so one token the sampler found far less likely than the trainer cannot dominate
    the step; truncated_tokens counts those with r > C."""
    assert cfg.importance_cap is not None  # validate_rl_loss: tis needs it
    log_c = np.log(cfg.importance_cap)
    return on, jnp.minimum(lr, log_c), {"truncated_tokens": jnp.sum(on & (lr > log_c))}


@register_importance("icepop")
def masked_importance(lr: jax.Array, on: jax.Array, cfg: RLLossConfig):
    """Masked importance sampling (IcePop): a token whose ratio leaves [1/C, C] gets no loss (the band
    [1/C, C] under another name, with its own count); masked_tokens counts them."""
    assert cfg.importance_cap is not None  # validate_rl_loss: icepop needs it
    c = float(cfg.importance_cap)
    keep = on & _within(lr, 1.0 / c, c)
    return keep, lr, {"masked_tokens": jnp.sum(on & ~keep)}


# --------------------------------------------------------------------------------------------------
# Per-token pieces
# --------------------------------------------------------------------------------------------------


def token_logprobs(
    hidden: jax.Array, head: jax.Array, targets: jax.Array, temperature: float = 1.0, chunks: int = 1
) -> tuple[jax.Array, jax.Array]:
    """log softmax(hidden @ head / temperature)[target] and the distribution's entropy per token.

    hidden: [batch, seq, embed]; head: [embed, vocab]; targets: int32[batch, seq] -> (logp
    float32[batch, seq], entropy float32[batch, seq], the latter without gradient). Computed
    `chunks` sequence pieces at a time, each rematerialised in the backward pass, so no
    [tokens, vocab] array outlives its chunk."""
    b, s, _ = hidden.shape
    if s % chunks:
        raise ValueError(f"chunks={chunks} must divide the sequence length {s}")
    c = s // chunks
    split = lambda x: jnp.moveaxis(x.reshape(b, chunks, c, *x.shape[2:]), 1, 0)

    @jax.checkpoint
    def chunk(xs):
        h, t = xs
        logits = linear(h, head, preferred_element_type=jnp.float32) / temperature
        log_z = jax.nn.logsumexp(logits, axis=-1)
        logp = jnp.take_along_axis(logits, t[..., None], axis=-1)[..., 0] - log_z
        probs = jax.lax.stop_gradient(jnp.exp(logits - log_z[..., None]))
        entropy = jax.lax.stop_gradient(log_z - jnp.sum(probs * logits, axis=-1))
        return logp, entropy

    logp, entropy = jax.lax.map(chunk, (split(hidden), split(targets)))
    join = lambda x: jnp.moveaxis(x, 0, 1).reshape(b, s)
    return join(logp), join(entropy)


def policy_loss(
    logp: jax.Array,
    sampler_logp: jax.Array,
    advantages: jax.Array,
    mask: jax.Array,
    weights: jax.Array,
    cfg: RLLossConfig,
    ref_logp: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The per-token objective of the module docstring, summed: (loss_sum, metric sums).

    All arrays float32 of one shape (e.g. [batch, seq]): logp = log pi of each target token
    (differentiable), sampler_logp = log mu, advantages, mask = 1 on policy tokens, weights = the
    aggregation's weights, ref_logp = log pi_ref (needed when cfg.kl_coef > 0). loss_sum is to be
    divided by the aggregation's denominator. Metric sums (no gradient): policy_tokens,
    kept_tokens, clipped_tokens, ratio, mismatch_kl_k1, mismatch_kl_k3, pg_loss, kl_loss, and
    kl_ref with a reference, plus the importance correction's own (truncated_tokens for tis,
    masked_tokens for icepop)."""
    mask = mask.astype(jnp.float32)
    on = mask > 0
    # 0 off the policy tokens: prompt and padding positions never reach exp()
    log_ratio = jnp.where(on, logp - sampler_logp, 0.0)
    lr = jax.lax.stop_gradient(log_ratio)
    keep, log_weight, correction_sums = IMPORTANCE_CORRECTIONS[importance_correction(cfg)](lr, on, cfg)
    # value T(r) = exp(log_weight), gradient T(r) d log pi: (log_ratio - lr) is exactly 0 in value.
    # Dropped tokens get log 0 too: an implausible (huge) ratio cannot overflow into the gradient
    ratio = jnp.exp(jnp.where(keep, (log_ratio - lr) + log_weight, 0.0))
    unclipped = ratio * advantages
    if cfg.clip_eps_low is None and cfg.clip_eps_high is None:
        pg = unclipped
        clipped_tok = jnp.zeros_like(mask)
    else:
        lo_r = 1.0 - cfg.clip_eps_low if cfg.clip_eps_low is not None else 0.0
        hi_r = 1.0 + cfg.clip_eps_high if cfg.clip_eps_high is not None else jnp.inf
        clipped = jnp.clip(ratio, lo_r, hi_r) * advantages
        pg = jnp.minimum(unclipped, clipped)
        clipped_tok = jax.lax.stop_gradient((clipped < unclipped).astype(jnp.float32))
    w = jnp.where(keep, weights, 0.0)
    keep_f = keep.astype(jnp.float32)
    pg_term = -pg
    sums: dict[str, jax.Array] = {}
    loss_sum = jnp.sum(w * pg_term)
    sums["pg_loss"] = jax.lax.stop_gradient(loss_sum)
    if cfg.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("rl.loss.kl_coef > 0 needs the reference log-probabilities (batch key ref_logprobs)")
        k1 = jax.lax.stop_gradient(jnp.where(on, logp - ref_logp, 0.0))
        kl_sum = jnp.sum(w * cfg.kl_coef * k1 * ratio)
        loss_sum = loss_sum + kl_sum
        sums["kl_loss"] = jax.lax.stop_gradient(kl_sum)
        sums["kl_ref"] = jnp.sum(mask * k1)
    capped = jnp.clip(lr, -_METRIC_LOG_RATIO_CAP, _METRIC_LOG_RATIO_CAP)
    sums.update(
        policy_tokens=mask.sum(),
        kept_tokens=keep_f.sum(),
        clipped_tokens=jnp.sum(keep_f * clipped_tok),
        ratio=jnp.sum(mask * jnp.exp(capped)),
        # KL(mu || pi) on tokens drawn from mu: k1 = log mu - log pi; k3 = (r - 1) - log r
        mismatch_kl_k1=jnp.sum(mask * -lr),
        mismatch_kl_k3=jnp.sum(mask * (jnp.expm1(capped) - capped)),
    )
    sums.update({k: v.astype(jnp.float32) for k, v in correction_sums.items()})
    return loss_sum, sums


# --------------------------------------------------------------------------------------------------
# The objective
# --------------------------------------------------------------------------------------------------


def replays_routing(cfg: Config) -> bool:
    """Whether the objective replays recorded routing: rl.loss.router_replay on a MoE model."""
    return cfg.rl.loss.router_replay and cfg.model.num_moe_layers > 0


def _shift_left(x: jax.Array) -> jax.Array:
    """Token-aligned -> prediction-aligned along seq (axis 1): position i gets token i+1's value."""
    pad = jnp.zeros((x.shape[0], 1) + x.shape[2:], x.dtype)
    return jnp.concatenate([x[:, 1:], pad], axis=1)


def prepare_rl_batch(batch: dict, cfg: Config, context: int, *, with_ref: bool, with_routing: bool) -> dict:
    """Token-aligned batch -> prediction-aligned arrays in layout order (every array's last two
    axes [batch, seq]; routing, which describes each input token and is not shifted, as
    int32[moe_layers, batch, seq, k] (`ROUTING_AXES`), the layout `forward(routing=)` takes).
    Position i predicts token i+1: its target, mask, sampler/reference log-probs and advantage are
    token i+1's; a target in another segment (or padding) has mask 0."""
    tokens = batch["tokens"].astype(jnp.int32)
    seg = batch["segment_ids"].astype(jnp.int32)
    b, s = tokens.shape
    same = (seg != 0) & (_shift_left(seg) == seg)
    mask = _shift_left(batch["loss_mask"].astype(jnp.float32)) * same
    out = {
        "tokens": tokens,
        "segment_ids": seg,
        "positions": batch["positions"].astype(jnp.int32),
        "order": jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)),
        "targets": _shift_left(tokens),
        "mask": mask,
        "advantages": _shift_left(batch["advantages"].astype(jnp.float32)),
        "sampler_logprobs": _shift_left(batch["sampler_logprobs"].astype(jnp.float32)),
    }
    if with_ref:
        out["ref_logprobs"] = _shift_left(batch["ref_logprobs"].astype(jnp.float32))
    if with_routing:
        out["routing"] = jnp.moveaxis(batch["routing"].astype(jnp.int32), 2, 0)
    if context > 1:
        perm = jnp.asarray(zigzag_permutation(s, context))
        out = {k: jnp.take(v, perm, axis=_seq_axis(k, v)) for k, v in out.items()}
    return out


def _seq_axis(key: str, x: jax.Array) -> int:
    return ROUTING_AXES.index("act_seq") if key == "routing" else x.ndim - 1


def prepare(params: Any, batch: dict, cfg: Config, context: int) -> tuple[dict, dict]:
    """`prepare_rl_batch` plus the aggregation's weights and the whole-batch denominators
    (loss: the aggregation's D; policy_tokens: for the per-token metrics)."""
    lc = cfg.rl.loss
    prep = prepare_rl_batch(batch, cfg, context, with_ref=lc.kl_coef > 0, with_routing=replays_routing(cfg))
    # per-row reductions do not care about the zigzag order of the sequence axis
    weights, denom = AGGREGATIONS[lc.aggregation](prep["mask"], lc.normalizer)
    prep["loss_weights"] = weights
    return prep, {"loss": denom, "policy_tokens": jnp.maximum(prep["mask"].sum(), 1.0)}


def _policy_forward(params: Any, mb: dict, cfg: Config, sharding: MeshRules | None, routing: jax.Array | None):
    m = cfg.model
    out = forward_microbatch(params, mb, m, sharding, routing=routing)
    chunks = ce_chunks(mb["tokens"].shape, sharding)
    logp, entropy = token_logprobs(out.hidden, output_head(params, m), mb["targets"], cfg.rl.loss.temperature, chunks)
    return out, logp, entropy


def loss_terms(params: Any, mb: dict, cfg: Config, denoms: dict, sharding: MeshRules | None):
    """One micro-batch's objective (divided by the whole-batch denominator) and metric sums."""
    out, logp, entropy = _policy_forward(params, mb, cfg, sharding, mb.get("routing"))
    loss_sum, sums = policy_loss(
        logp,
        mb["sampler_logprobs"],
        mb["advantages"],
        mb["mask"],
        mb["loss_weights"],
        cfg.rl.loss,
        ref_logp=mb.get("ref_logprobs"),
    )
    sums["entropy"] = jnp.sum(mb["mask"] * entropy)
    if "expert_counts" in out.aux:
        sums["expert_counts"] = out.aux["expert_counts"]
        sums["seq_balance"] = out.aux["seq_balance"]
    sums.update(moe_exchange_sums(out.aux))  # the step reports dropped assignments and exchange bytes
    return loss_sum / denoms["loss"], sums


def metrics(sums: dict, denoms: dict, cfg: Config) -> dict:
    """pg_loss / kl_loss (the objective's two parts), per-policy-token means (entropy, ratio_mean,
    mismatch_kl_k1 / _k3 between sampler and trainer, kl_ref), filtered_fraction (of policy
    tokens), clip_fraction (of kept tokens), policy_tokens, and the importance correction's:
    truncated_fraction (tis: of policy tokens, r > C) or masked_fraction (icepop: of policy
    tokens, r outside [1/C, C]; the same tokens as filtered_fraction)."""
    tokens = denoms["policy_tokens"]
    out = {
        "pg_loss": sums["pg_loss"] / denoms["loss"],
        "entropy": sums["entropy"] / tokens,
        "ratio_mean": sums["ratio"] / tokens,
        "mismatch_kl_k1": sums["mismatch_kl_k1"] / tokens,
        "mismatch_kl_k3": sums["mismatch_kl_k3"] / tokens,
        "filtered_fraction": 1.0 - sums["kept_tokens"] / tokens,
        "clip_fraction": sums["clipped_tokens"] / jnp.maximum(sums["kept_tokens"], 1.0),
        "policy_tokens": sums["policy_tokens"],
    }
    if "kl_loss" in sums:
        out["kl_loss"] = sums["kl_loss"] / denoms["loss"]
        out["kl_ref"] = sums["kl_ref"] / tokens
    for key, metric in (("truncated_tokens", "truncated_fraction"), ("masked_tokens", "masked_fraction")):
        if key in sums:
            out[metric] = sums[key] / tokens
    return out


def rl_objective(cfg: Config) -> Objective:
    """The RL objective for this run: its batch keys are `BASE_KEYS`, plus ref_logprobs when
    rl.loss.kl_coef > 0 and routing when the model is MoE and rl.loss.router_replay is on.
    Pass it to `train.step.make_train_step(..., objective=)` / `batch_gradients`."""
    keys = BASE_KEYS + (("ref_logprobs",) if cfg.rl.loss.kl_coef > 0 else ())
    keys += ("routing",) if replays_routing(cfg) else ()
    return Objective(
        name="rl",
        batch_keys=keys,
        prepare=prepare,
        terms=loss_terms,
        metrics=metrics,
        prepared_axes={"routing": ROUTING_AXES},
    )


def reference_logprobs(
    ref_params: Any, batch: dict, cfg: Config, sharding: MeshRules | None = None, *, replay: bool = False
) -> jax.Array:
    """log pi_ref of every token under the frozen reference parameters: float32[batch, seq],
    token-aligned like `sampler_logprobs` (index i is token i's; 0 where no prediction reaches it:
    the first token of each segment and padding). The batch as the objective takes it, without
    ref_logprobs. replay: route with the batch's recorded experts (default: the reference model
    routes itself). Pure; jit it with the step's shardings (see tests/rl).

    Run train.micro_batches shares of the rows at a time (rows j, j + micro, ... as the train step
    splits them, so each device keeps its own rows), one after another: the forward's working set is
    a micro-batch's, as in the step, not the whole batch's (at Kimi K2 size the difference between
    fitting an H200 and not, `composer-jax inspect` on configs/rl/kimi_k2_h200.yaml)."""
    micro = cfg.train.micro_batches
    if micro <= 1 or batch["tokens"].shape[0] % micro:
        return _reference_rows(ref_params, batch, cfg, sharding, replay)
    split = {k: rearrange(jnp.asarray(v), "(row micro) ... -> micro row ...", micro=micro) for k, v in batch.items()}
    out = jax.lax.map(lambda mb: _reference_rows(ref_params, mb, cfg, sharding, replay), split)
    return rearrange(out, "micro row seq -> (row micro) seq")


def _reference_rows(ref_params: Any, batch: dict, cfg: Config, sharding: MeshRules | None, replay: bool) -> jax.Array:
    """`reference_logprobs` of these rows in one forward."""
    s = batch["tokens"].shape[1]
    context = context_size(sharding)
    with_routing = replay and "routing" in batch
    prep = prepare_rl_batch(batch, cfg, context, with_ref=False, with_routing=with_routing)
    _, logp, _ = _policy_forward(ref_params, prep, cfg, sharding, prep.get("routing"))
    logp = jax.lax.stop_gradient(logp)
    if context > 1:  # back to the original order
        logp = jnp.take(logp, jnp.asarray(np.argsort(zigzag_permutation(s, context))), axis=1)
    seg = batch["segment_ids"].astype(jnp.int32)
    valid = jnp.concatenate([jnp.zeros_like(seg[:, :1], bool), (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)], 1)
    # prediction at i is token i+1's: shift right to align with the tokens
    return jnp.where(valid, jnp.concatenate([jnp.zeros_like(logp[:, :1]), logp[:, :-1]], axis=1), 0.0)
