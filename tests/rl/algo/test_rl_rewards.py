"""Rewards: the nonlinear length penalty C_{k,q} against hand values and its q = 1 limit (exactly at
q = 1 and numerically near it), and the composition of the reward's weighted components."""

from __future__ import annotations

import math

import numpy as np
import pytest

from composer_jax.config import LengthPenaltyConfig, RewardConfig
from composer_jax.rl.algo.rewards import RolloutStats, compose_reward, length_penalty, mean_components


@pytest.mark.parametrize(
    "k, q, x, expected",
    [
        # q = 0: ((1 + kx) - 1) / k = x, linear whatever k
        (0.1, 0.0, 10.0, 10.0),
        (0.01, 0.0, 250.0, 250.0),
        # q = 0.5, k = 0.1, x = 10: (2^0.5 - 1) / (0.1 * 0.5) = 0.41421356 / 0.05 = 8.2842712
        (0.1, 0.5, 10.0, (math.sqrt(2.0) - 1.0) / 0.05),
        # q = 2, k = 0.1, x = 10: (2^-1 - 1) / (0.1 * -1) = -0.5 / -0.1 = 5
        (0.1, 2.0, 10.0, 5.0),
        # q = 2, k = 1, x = 3: (4^-1 - 1) / (1 * -1) = 0.75
        (1.0, 2.0, 3.0, 0.75),
        # q = 1: log(1 + kx) / k; k = 0.1, x = 10: ln 2 / 0.1 = 6.9314718
        (0.1, 1.0, 10.0, math.log(2.0) / 0.1),
        # q = 1, k = 0.01, x = 100: ln 2 / 0.01 = 69.314718
        (0.01, 1.0, 100.0, math.log(2.0) / 0.01),
        # q = 3, k = 1, x = 1: (2^-2 - 1) / (1 * -2) = 0.375
        (1.0, 3.0, 1.0, 0.375),
        # x = 0 is 0 for every q
        (0.5, 1.0, 0.0, 0.0),
        (0.5, 1.7, 0.0, 0.0),
    ],
)
def test_length_penalty_hand_values(k, q, x, expected):
    assert float(length_penalty(x, k, q)) == pytest.approx(expected, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("k", [0.01, 0.1, 1.0])
@pytest.mark.parametrize("eps", [1e-3, 1e-6, 1e-9, 1e-12, 1e-15, 1e-300])
def test_length_penalty_is_continuous_through_q_equals_one(k, eps):
    # C = L (1 + aL/2 + (aL)^2/6 + ...) / k with a = 1 - q, L = log(1 + kx): near q = 1 it is the log
    # limit plus a first-order term a L^2 / (2k). The naive ((1+kx)^a - 1) / (k a) keeps only ~4 of
    # 16 digits at a = 1e-12 (1 + 1e-12 L is rounded: errors of 1e-5..6e-4 at k = 0.1); this must not.
    x = np.asarray([1.0, 10.0, 100.0, 1000.0])
    log_term = np.log1p(k * x)
    for a in (eps, -eps):
        # reference: expm1(y) / y = sum_n y^n / (n + 1)! with y = aL, 12 terms (|y| < 0.01 here, so the
        # truncation is below 1e-30 relative), times L / k
        y = a * log_term
        ref = log_term / k * sum(y**n / math.factorial(n + 1) for n in range(12))
        np.testing.assert_allclose(length_penalty(x, k, 1.0 - a), ref, rtol=1e-13)
    np.testing.assert_allclose(length_penalty(x, k, 1.0), log_term / k, rtol=1e-15)


def test_length_penalty_shapes_for_the_paper():
    # increasing in x with slope 1 at 0 for every q; q > 1 saturates at 1 / (k (q - 1))
    x = np.linspace(0.0, 1e4, 101)
    for q in (0.0, 0.5, 1.0, 1.5, 2.0):
        c = length_penalty(x, 0.01, q)
        assert np.all(np.diff(c) > 0)
        assert float(length_penalty(1e-9, 0.01, q)) == pytest.approx(1e-9, rel=1e-6)
    assert float(length_penalty(1e12, 0.01, 2.0)) == pytest.approx(1.0 / (0.01 * 1.0), rel=1e-6)
    with pytest.raises(ValueError, match="k=0 must be > 0"):
        length_penalty(1.0, 0, 1.0)
    with pytest.raises(ValueError, match="x must be finite and >= 0"):
        length_penalty(-1.0, 0.1, 1.0)


def test_reward_composition_components_weighted_and_separate():
    # grade 1 * 2.0 = 2.0
    # length over turns = 4, k = 0.5, q = 2: C = (3^-1 - 1) / (0.5 * -1) = (2/3) / 0.5 = 4/3;
    #   weight 0.3 -> -0.4
    # broken tool calls 2 * 0.1 -> -0.2 ; lint findings 5 * 0.02 -> -0.1
    # parallel: 1 of 4 turns had several tool calls -> 0.25 * 0.4 = 0.1
    # total = 2.0 - 0.4 - 0.2 - 0.1 + 0.1 = 1.4
    cfg = RewardConfig(
        grade_weight=2.0,
        length_penalty=LengthPenaltyConfig(weight=0.3, k=0.5, q=2.0, x="turns"),
        broken_tool_call_penalty=0.1,
        style_penalty=0.02,
        parallel_tool_bonus=0.4,
    )
    stats = RolloutStats(
        grade=1.0, tokens=900, turns=4, tool_calls=6, broken_tool_calls=2, parallel_tool_turns=1, lint_findings=5
    )
    r = compose_reward(stats, cfg)
    assert r.grade == pytest.approx(2.0)
    assert r.length_penalty == pytest.approx(-0.4)
    assert r.broken_tool_calls == pytest.approx(-0.2)
    assert r.style == pytest.approx(-0.1)
    assert r.parallel_tool_use == pytest.approx(0.1)
    assert r.total == pytest.approx(1.4)
    # the same penalty over tool calls (x = 6): C = (4^-1 - 1) / -0.5 = 1.5 -> -0.45; over tokens:
    # x = 900: (451^-1 - 1) / -0.5 = 1.9955654 -> -0.5986696
    over_calls = LengthPenaltyConfig(weight=0.3, k=0.5, q=2.0, x="tool_calls")
    assert compose_reward(stats, RewardConfig(length_penalty=over_calls)).length_penalty == pytest.approx(-0.45)
    over_tokens = LengthPenaltyConfig(weight=0.3, k=0.5, q=2.0, x="tokens")
    got = compose_reward(stats, RewardConfig(length_penalty=over_tokens)).length_penalty
    assert got == pytest.approx(-0.3 * (1 - 1 / 451) / 0.5)
    # no lint (None) is no style term; defaults are the grade alone, and no component is -0.0
    plain = compose_reward(RolloutStats(grade=0.5, tokens=10, turns=1, tool_calls=0), RewardConfig())
    assert plain.as_dict() == {
        "total": 0.5,
        "grade": 0.5,
        "length_penalty": 0.0,
        "broken_tool_calls": 0.0,
        "style": 0.0,
        "parallel_tool_use": 0.0,
    }
    assert all(math.copysign(1.0, v) == 1.0 for v in plain.as_dict().values())
    means = mean_components([r, plain])
    assert means["reward/total"] == pytest.approx((1.4 + 0.5) / 2)
    assert means["reward/style"] == pytest.approx(-0.05)


def test_rollout_stats_reject_impossible_counts():
    with pytest.raises(ValueError, match="broken_tool_calls=-1 must be >= 0"):
        RolloutStats(grade=1.0, tokens=1, turns=1, tool_calls=0, broken_tool_calls=-1)
    with pytest.raises(ValueError, match="parallel_tool_turns=3 exceeds turns=2"):
        RolloutStats(grade=1.0, tokens=1, turns=2, tool_calls=6, parallel_tool_turns=3)
