"""The RL objective's pieces against numbers worked by hand (the working is in the comments):
group advantages, the aggregations and their denominators, the importance ratio with and without
PPO clipping, the k1 KL term, the importance corrections (plausibility band, truncated and masked
importance sampling, also against a numpy reference of the whole per-token objective) and the
mismatch metrics."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.config.rl import ADVANTAGE_ESTIMATORS as ADV_NAMES
from composer_jax.config.rl import AGGREGATIONS as AGG_NAMES
from composer_jax.config.rl import IMPORTANCE_CORRECTIONS as IS_NAMES
from composer_jax.config.rl import RLLossConfig
from composer_jax.errors import ConfigError
from composer_jax.rl.algo.advantages import ADVANTAGE_ESTIMATORS, advantages
from composer_jax.rl.algo.loss import AGGREGATIONS, IMPORTANCE_CORRECTIONS, policy_loss

LN2 = math.log(2.0)


def test_registries_hold_exactly_the_configurable_names():
    assert sorted(ADVANTAGE_ESTIMATORS) == sorted(ADV_NAMES)
    assert sorted(AGGREGATIONS) == sorted(AGG_NAMES)
    assert sorted(IMPORTANCE_CORRECTIONS) == sorted(IS_NAMES)


def test_drgrpo_advantages_are_reward_minus_group_mean():
    # groups interleaved: a = [1, 0, 0, 1] (mean 0.5), b = [1, 1, 1] (mean 1), c = [0.2] (alone)
    rewards = [1.0, 1.0, 0.0, 1.0, 0.0, 0.2, 1.0, 1.0]
    groups = ["a", "b", "a", "b", "a", "c", "a", "b"]
    adv = advantages("drgrpo", np.asarray(rewards), groups)
    np.testing.assert_allclose(adv, [0.5, 0.0, -0.5, 0.0, -0.5, 0.0, 0.5, 0.0], atol=1e-15)
    # the group mean of the advantages is 0 in every group (Dr. GRPO is centred, not scaled)
    np.testing.assert_allclose([adv[[0, 2, 4, 6]].sum(), adv[[1, 3, 7]].sum()], [0.0, 0.0], atol=1e-15)


def test_grpo_divides_by_the_groups_sample_std():
    # group a = [1, 0, 0, 1]: deviations +-0.5, sum of squares 1, / (4 - 1) -> var 1/3, std 0.5773503;
    # A = +-0.5 / (0.5773503 + 1e-6) = +-0.8660239. group d = [3, 1]: deviations +-1, var 2 / 1,
    # std 1.4142136 -> A = +-0.7071063. group b = [1, 1, 1]: std 0 -> 0 / 1e-6 = 0.
    rewards = [1.0, 0.0, 0.0, 1.0, 3.0, 1.0, 1.0, 1.0, 1.0]
    groups = [0, 0, 0, 0, 1, 1, 2, 2, 2]
    adv = advantages("grpo", np.asarray(rewards), groups)
    a = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    d = 1.0 / (math.sqrt(2.0) + 1e-6)
    np.testing.assert_allclose(adv, [a, -a, -a, a, d, -d, 0, 0, 0], rtol=1e-12)
    assert abs(a - 0.8660239) < 1e-6 and abs(d - 0.7071063) < 1e-6


def test_advantages_reject_bad_input():
    with pytest.raises(ValueError, match="'ppo' is not registered; registered: \\['drgrpo', 'grpo'\\]"):
        advantages("ppo", np.ones(2), [0, 0])
    with pytest.raises(ValueError, match="2 rewards but 3 group ids"):
        advantages("drgrpo", np.ones(2), [0, 0, 1])
    with pytest.raises(ValueError, match="finite 1-D array"):
        advantages("drgrpo", np.asarray([1.0, np.nan]), [0, 0])


def test_aggregations_weights_and_denominators():
    mask = jnp.asarray([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    # token_sum: weights = mask; D = the constant, by default rows x seq = 3 x 4 = 12
    w, d = AGGREGATIONS["token_sum"](mask, 0.0)
    np.testing.assert_array_equal(w, mask)
    assert float(d) == 12.0
    assert float(AGGREGATIONS["token_sum"](mask, 1000.0)[1]) == 1000.0
    # token_mean: D = policy tokens = 2 + 4 = 6
    w, d = AGGREGATIONS["token_mean"](mask, 1000.0)
    np.testing.assert_array_equal(w, mask)
    assert float(d) == 6.0
    # sequence_mean: each row's tokens weigh 1 / its length (1/2, 1/4), D = rows with tokens = 2
    w, d = AGGREGATIONS["sequence_mean"](mask, 0.0)
    np.testing.assert_allclose(w, [[0.5, 0.5, 0, 0], [0.25] * 4, [0] * 4])
    assert float(d) == 2.0


def _run(cfg, log_ratio, adv, mask, ref_delta=None):
    """policy_loss on per-token log ratios (logp = sampler_logp + log_ratio, sampler_logp = -3),
    with weights = mask; returns (loss_sum, sums, d loss_sum / d logp)."""
    sampler = jnp.full(len(log_ratio), -3.0)
    mask = jnp.asarray(mask, jnp.float32)

    def f(logp):
        ref = None if ref_delta is None else logp - jnp.asarray(ref_delta, jnp.float32)
        return policy_loss(logp, sampler, jnp.asarray(adv, jnp.float32), mask, mask, cfg, ref)

    logp = sampler + jnp.asarray(log_ratio, jnp.float32)
    (loss, sums), grad = jax.value_and_grad(f, has_aux=True)(logp)
    return float(loss), {k: float(v) for k, v in sums.items()}, np.asarray(grad)


def test_importance_ratio_without_clipping():
    # ratios r = 2, 0.5, 1 with A = 1, -1, 2; the 4th token is not a policy token (mask 0) and has a
    # log-ratio of 100 that must not reach exp() (inf * 0 would be nan in the loss or the gradient).
    # loss_sum = -(2 * 1) - (0.5 * -1) - (1 * 2) = -2 + 0.5 - 2 = -3.5
    # d(-r A)/d logp = -r A: -2, +0.5, -2, and 0 on the masked token
    loss, sums, grad = _run(RLLossConfig(), [LN2, -LN2, 0.0, 100.0], [1.0, -1.0, 2.0, 5.0], [1, 1, 1, 0])
    assert loss == pytest.approx(-3.5, abs=1e-6)
    np.testing.assert_allclose(grad, [-2.0, 0.5, -2.0, 0.0], atol=1e-6)
    assert sums["policy_tokens"] == 3 and sums["kept_tokens"] == 3 and sums["clipped_tokens"] == 0
    # mean ratio over policy tokens: (2 + 0.5 + 1) / 3 = 3.5 / 3
    assert sums["ratio"] / 3 == pytest.approx(3.5 / 3, rel=1e-6)


def test_ppo_clipping():
    # eps_low 0.2, eps_high 0.3: the ratio is clipped to [0.8, 1.3] and min(r A, clip(r) A) taken
    #   r=2,   A=+1: min(2, 1.3)     = 1.3   clipped, no gradient
    #   r=0.5, A=-1: min(-0.5, -0.8) = -0.8  clipped, no gradient
    #   r=1,   A=+2: min(2, 2)       = 2     inside,  d(-rA)/dlogp = -2
    #   r=2,   A=-1: min(-2, -1.3)   = -2    unclipped side is smaller: d(-rA)/dlogp = +2
    #   r=0.5, A=+1: min(0.5, 0.8)   = 0.5   unclipped side is smaller: d/dlogp = -0.5
    # loss_sum = -(1.3 - 0.8 + 2 - 2 + 0.5) = -1.0; clipped 2 of 5 kept tokens
    cfg = RLLossConfig(clip_eps_low=0.2, clip_eps_high=0.3)
    lr = [LN2, -LN2, 0.0, LN2, -LN2]
    adv = [1.0, -1.0, 2.0, -1.0, 1.0]
    loss, sums, grad = _run(cfg, lr, adv, [1] * 5)
    assert loss == pytest.approx(-1.0, abs=1e-6)
    np.testing.assert_allclose(grad, [0.0, 0.0, -2.0, 2.0, -0.5], atol=1e-6)
    assert sums["clipped_tokens"] == 2 and sums["kept_tokens"] == 5
    # one-sided (high only): r=0.5, A=-1 is no longer clipped: -0.5 instead of -0.8, gradient +0.5
    loss, sums, grad = _run(dataclasses.replace(cfg, clip_eps_low=None), lr, adv, [1] * 5)
    assert loss == pytest.approx(-(1.3 - 0.5 + 2 - 2 + 0.5), abs=1e-6)
    np.testing.assert_allclose(grad, [0.0, 0.5, -2.0, 2.0, -0.5], atol=1e-6)
    assert sums["clipped_tokens"] == 1


def test_k1_kl_term_value_and_gradient():
    # on-policy (r = 1), A = 0: only the KL term. k1 = log pi - log pi_ref = 0.5, -0.2, 1.0 (and a
    # masked token). beta = 0.1: loss_sum = beta * sum(k1 * r) = 0.1 * 1.3 = 0.13; kl_ref sum 1.3.
    # The gradient is beta * k1 * d r / d logp = beta * k1 (k1 as a per-token negative reward, the
    # gradient of KL(pi || pi_ref)), not beta (what adding k1 itself to the loss would give).
    cfg = RLLossConfig(kl_coef=0.1)
    loss, sums, grad = _run(cfg, [0.0] * 4, [0.0] * 4, [1, 1, 1, 0], ref_delta=[0.5, -0.2, 1.0, 7.0])
    assert loss == pytest.approx(0.13, abs=1e-6)
    assert sums["kl_ref"] == pytest.approx(1.3, abs=1e-6)
    assert sums["kl_loss"] == pytest.approx(0.13, abs=1e-6) and sums["pg_loss"] == 0.0
    np.testing.assert_allclose(grad, [0.05, -0.02, 0.1, 0.0], atol=1e-6)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(jnp.zeros(2), jnp.zeros(2), jnp.zeros(2), jnp.ones(2), jnp.ones(2), cfg, None)


def test_plausibility_mask():
    # band [0.5, 2]: r = 3 and r = 0.25 are dropped, r = 1.5 and 0.6 kept; the 5th token has
    # log r = 200 (exp overflows float32) and is dropped without a nan anywhere; A = 1 for all.
    # loss_sum = -(1.5 + 0.6) = -2.1; gradient -r on the kept tokens, 0 on the dropped ones;
    # filtered: 3 of 5 policy tokens
    cfg = RLLossConfig(plausibility_band=(0.5, 2.0))
    lr = [math.log(3.0), math.log(0.25), math.log(1.5), math.log(0.6), 200.0]
    loss, sums, grad = _run(cfg, lr, [1.0] * 5, [1] * 5)
    assert loss == pytest.approx(-2.1, abs=1e-6)
    np.testing.assert_allclose(grad, [0.0, 0.0, -1.5, -0.6, 0.0], atol=1e-6)
    assert (sums["policy_tokens"], sums["kept_tokens"]) == (5, 2)
    assert all(math.isfinite(v) for v in sums.values())


def test_mismatch_metrics():
    # KL(sampler || trainer) on the sampled tokens, log r = log pi - log mu:
    #   k1 = -log r: -ln 2 + ln 2 + 0 = 0 for r = 2, 0.5, 1
    #   k3 = (r - 1) - log r: (1 - 0.693147) + (-0.5 + 0.693147) + 0 = 0.5
    _, sums, _ = _run(RLLossConfig(), [LN2, -LN2, 0.0], [0.0] * 3, [1, 1, 1])
    assert sums["mismatch_kl_k1"] == pytest.approx(0.0, abs=1e-6)
    assert sums["mismatch_kl_k3"] == pytest.approx(0.5, abs=1e-6)
    # k1 alone is not: r = 2, 2 -> k1 = -2 ln 2 = -1.386294, k3 = 2 (1 - ln 2) = 0.613706
    _, sums, _ = _run(RLLossConfig(), [LN2, LN2], [0.0] * 2, [1, 1])
    assert sums["mismatch_kl_k1"] == pytest.approx(-2 * LN2, abs=1e-6)
    assert sums["mismatch_kl_k3"] == pytest.approx(2 * (1 - LN2), abs=1e-6)


def test_truncated_importance_sampling():
    # tis, C = 2: r = 3, 0.25, 1.5, and e^200 (overflows float32) all keep a loss, each weighted
    # min(r, 2) = 2, 0.25, 1.5, 2; A = 1, -1, 1, 1. loss_sum = -(2 - 0.25 + 1.5 + 2) = -5.25, and
    # the gradient is -min(r, 2) A (truncated, not zeroed as clipping would): -2, 0.25, -1.5, -2.
    # truncated: r = 3 and r = e^200, 2 of 4 policy tokens; nothing is filtered.
    cfg = RLLossConfig(importance="tis", importance_cap=2.0)
    lr = [math.log(3.0), math.log(0.25), math.log(1.5), 200.0]
    loss, sums, grad = _run(cfg, lr, [1.0, -1.0, 1.0, 1.0], [1] * 4)
    assert loss == pytest.approx(-5.25, abs=1e-6)
    np.testing.assert_allclose(grad, [-2.0, 0.25, -1.5, -2.0], atol=1e-6)
    assert (sums["kept_tokens"], sums["truncated_tokens"]) == (4, 2)
    assert all(math.isfinite(v) for v in sums.values())


def test_icepop_masks_ratios_outside_the_cap():
    # icepop, C = 2: kept are ratios in [0.5, 2]: r = 2 (on the edge) and 0.6; dropped r = 3,
    # 0.25 and e^200. A = 1: loss_sum = -(2 + 0.6) = -2.6, gradient -r on the kept tokens, masked 3/5
    cfg = RLLossConfig(importance="icepop", importance_cap=2.0)
    lr = [math.log(3.0), math.log(0.25), LN2, math.log(0.6), 200.0]
    loss, sums, grad = _run(cfg, lr, [1.0] * 5, [1] * 5)
    assert loss == pytest.approx(-2.6, abs=1e-6)
    np.testing.assert_allclose(grad, [0.0, 0.0, -2.0, -0.6, 0.0], atol=1e-6)
    assert (sums["kept_tokens"], sums["masked_tokens"]) == (2, 3)


def _numpy_policy_loss(lr, adv, mask, w, k1, cfg):
    """The per-token objective of docs/rl.md in float64 numpy, with its gradient d loss / d log pi
    written out by hand: (loss_sum, gradient, kept, truncated)."""
    name = cfg.importance or ("band" if cfg.plausibility_band else "none")
    on = mask > 0
    r = np.exp(np.where(on, lr, 0.0))
    if name == "band":
        lo, hi = cfg.plausibility_band
    elif name == "icepop":
        lo, hi = 1.0 / cfg.importance_cap, cfg.importance_cap
    else:
        lo, hi = 0.0, np.inf
    keep = on & (r >= lo) & (r <= hi)
    q = np.where(keep, np.minimum(r, cfg.importance_cap) if name == "tis" else r, 0.0)
    c_lo = 1 - cfg.clip_eps_low if cfg.clip_eps_low is not None else 0.0
    c_hi = 1 + cfg.clip_eps_high if cfg.clip_eps_high is not None else np.inf
    clipped = np.clip(q, c_lo, c_hi) * adv
    pg = np.minimum(q * adv, clipped)
    # the unclipped branch (value q A, gradient q A) is taken unless the clipped one is smaller
    d_pg = np.where(q * adv <= clipped, q * adv, 0.0)
    per_token = w * keep * (-pg + cfg.kl_coef * k1 * q)
    grad = w * keep * (-d_pg + cfg.kl_coef * k1 * q)
    truncated = on & (r > cfg.importance_cap) if name == "tis" else np.zeros_like(on)
    return per_token.sum(), grad, keep.sum(), truncated.sum()


@pytest.mark.parametrize(
    "loss_kw",
    [
        {"importance": "tis", "importance_cap": 1.5, "clip_eps_low": 0.2, "clip_eps_high": 0.28, "kl_coef": 0.1},
        {"importance": "tis", "importance_cap": 2.0},
        {"importance": "icepop", "importance_cap": 1.5, "clip_eps_low": 0.2, "clip_eps_high": 0.28, "kl_coef": 0.1},
        {"plausibility_band": (0.5, 2.0), "clip_eps_high": 0.28},
        {"importance": "none", "kl_coef": 0.05},
    ],
)
def test_importance_corrections_against_the_numpy_reference(loss_kw):
    # 64 tokens of random log ratios (spread well past every cap), advantages, weights and k1; a
    # quarter are not policy tokens (their huge log ratios must not matter)
    cfg = RLLossConfig(**loss_kw)
    rng = np.random.default_rng(3)
    n = 64
    lr = rng.normal(0.0, 0.8, n)
    mask = (rng.random(n) < 0.75).astype(np.float64)
    lr = np.where(mask > 0, lr, 50.0)
    adv, w, k1 = rng.normal(0.0, 1.0, n), rng.random(n), rng.normal(0.0, 0.3, n)
    want_loss, want_grad, want_kept, want_trunc = _numpy_policy_loss(lr, adv, mask, w, k1, cfg)
    sampler = jnp.full(n, -2.0)
    f32 = lambda x: jnp.asarray(x, jnp.float32)

    def f(logp):
        return policy_loss(logp, sampler, f32(adv), f32(mask), f32(w), cfg, logp - f32(k1))

    (loss, sums), grad = jax.value_and_grad(f, has_aux=True)(sampler + f32(lr))
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5, atol=1e-6)
    assert float(sums["kept_tokens"]) == want_kept
    assert float(sums.get("truncated_tokens", 0.0)) == want_trunc
    # the random ratios reach every branch the correction has: some tokens truncated or dropped
    if "importance_cap" in loss_kw:
        assert 0 < (want_trunc if loss_kw["importance"] == "tis" else mask.sum() - want_kept) < mask.sum()


def test_importance_config_checks():
    # configs that predate rl.loss.importance mean what they did: a band is the band correction
    assert RLLossConfig(plausibility_band=(0.5, 2.0)).importance is None
    bad = [
        ({"importance": "ppo"}, "rl.loss.importance='ppo' is not accepted; accepted: .*'tis', 'icepop'"),
        ({"importance": "tis"}, "rl.loss.importance='tis' needs rl.loss.importance_cap"),
        ({"importance": "icepop", "importance_cap": 1.0}, "importance_cap=1.0: expected a number > 1"),
        ({"importance": "band"}, "'band' needs rl.loss.plausibility_band"),
        (
            {"importance": "tis", "importance_cap": 2.0, "plausibility_band": (0.5, 2.0)},
            "plausibility_band=\\[0.5, 2.0\\] with rl.loss.importance='tis'",
        ),
        ({"importance_cap": 2.0}, "importance_cap=2.0 with rl.loss.importance='none'"),
    ]
    for kw, message in bad:
        with pytest.raises(ConfigError, match=message):
            RLLossConfig(**kw)
