"""Rollouts -> the objective's padded batch: rows, padding, per-rollout advantages over groups (a
self-summarisation chain counts once and its reward reaches every generation), recorded routing,
and the errors a caller can cause."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from composer_jax.config import Config, ModelConfig, RLConfig, RLLossConfig, TrainConfig
from composer_jax.rl.algo.batch import GenerationRecord, ScoredRollout, build_batch, version_lag

# 2 MoE layers (3 layers, the first dense), top-2 of 8 experts
MODEL = ModelConfig(num_layers=3, first_k_dense=1, num_experts=8, num_experts_per_tok=2)
CFG = Config(model=MODEL, train=TrainConfig(batch_size=6, seq_len=8))


def _gen(n_prompt: int, n_policy: int, base: int, routing: bool = True, version: int = 3) -> GenerationRecord:
    n = n_prompt + n_policy
    routing_arr = (np.arange((n - 1) * 2 * 2).reshape(n - 1, 2, 2) % 8).astype(np.int32) if routing else None
    return GenerationRecord(
        tokens=list(range(base, base + n)),
        loss_mask=[0] * n_prompt + [1] * n_policy,
        logprobs=[0.0] * n_prompt + [-0.5] * n_policy,
        versions=[version] * n,
        routing=routing_arr,
    )


def test_rows_padding_advantages_and_routing():
    # group "a": rewards 1 and 0 -> Dr. GRPO advantages +0.5, -0.5.
    # group "b": a two-generation chain (reward 0.2) and a single one (reward 0.6): mean 0.4, so
    # -0.2 on both generations of the chain (it counts once in the mean, not twice) and +0.2.
    rollouts = [
        ScoredRollout("a", 1.0, [_gen(2, 3, 10)]),
        ScoredRollout("a", 0.0, [_gen(3, 2, 20)]),
        ScoredRollout("b", 0.2, [_gen(4, 4, 30), _gen(2, 1, 40)]),
        ScoredRollout("b", 0.6, [_gen(1, 1, 50)]),
    ]
    batch = build_batch(rollouts, CFG)
    keys = {"tokens", "segment_ids", "positions", "loss_mask", "advantages", "sampler_logprobs", "routing"}
    assert set(batch) == keys
    assert batch["tokens"].shape == (6, 8) and batch["routing"].shape == (6, 8, 2, 2)
    assert batch["tokens"].dtype == np.int32 and batch["routing"].dtype == np.int32
    assert batch["loss_mask"].dtype == np.float32 and batch["advantages"].dtype == np.float32
    np.testing.assert_array_equal(batch["tokens"][0], [10, 11, 12, 13, 14, 0, 0, 0])
    np.testing.assert_array_equal(batch["segment_ids"][2], [1] * 8)
    np.testing.assert_array_equal(batch["segment_ids"][3], [1, 1, 1, 0, 0, 0, 0, 0])
    np.testing.assert_array_equal(batch["positions"][1], [0, 1, 2, 3, 4, 0, 0, 0])
    np.testing.assert_array_equal(batch["loss_mask"][0], [0, 0, 1, 1, 1, 0, 0, 0])
    np.testing.assert_array_equal(batch["sampler_logprobs"][0], [0, 0, -0.5, -0.5, -0.5, 0, 0, 0])
    np.testing.assert_allclose(batch["advantages"][:, 0], [0.5, -0.5, -0.2, -0.2, 0.2, 0.0], atol=1e-7)
    np.testing.assert_allclose(batch["advantages"][0], [0.5] * 5 + [0.0] * 3, atol=1e-7)
    # the last row is padding: no tokens, no loss
    assert batch["segment_ids"][5].sum() == 0 and batch["loss_mask"][5].sum() == 0
    # routing: the recorded n - 1 tokens copied; the last token and padding get experts (0, 1)
    np.testing.assert_array_equal(batch["routing"][0, :4], rollouts[0].generations[0].routing)
    np.testing.assert_array_equal(batch["routing"][0, 4:], np.broadcast_to([0, 1], (4, 2, 2)))
    assert version_lag(rollouts, 5) == {"version_lag_mean": 2.0, "version_lag_max": 2.0}


def test_grpo_estimator_and_no_routing_without_replay():
    cfg = dataclasses.replace(CFG, rl=RLConfig(loss=RLLossConfig(advantage="grpo", router_replay=False)))
    # rewards 1, 0 in one group: deviations +-0.5, sample std sqrt(0.5) = 0.7071068 -> +-0.7071058
    rollouts = [ScoredRollout(0, 1.0, [_gen(1, 1, 1, routing=False)]), ScoredRollout(0, 0.0, [_gen(1, 1, 5)])]
    batch = build_batch(rollouts, cfg)
    assert "routing" not in batch
    np.testing.assert_allclose(batch["advantages"][:2, 0], [0.5 / (0.5**0.5 + 1e-6), -0.5 / (0.5**0.5 + 1e-6)])


def test_errors_name_the_rollout_and_what_is_accepted():
    with pytest.raises(ValueError, match=r"rollout 1 \(row 1\) has 9 tokens; a generation must have 1..seq_len=8"):
        build_batch([ScoredRollout(0, 1.0, [_gen(1, 1, 1)]), ScoredRollout(0, 1.0, [_gen(4, 5, 1)])], CFG)
    with pytest.raises(ValueError, match="hold 7 generations .* batch_size=6"):
        build_batch([ScoredRollout(i, 1.0, [_gen(1, 1, 1)]) for i in range(7)], CFG)
    bad = _gen(2, 2, 1)
    bad.logprobs = [0.0] * 3
    with pytest.raises(ValueError, match="logprobs has 3 entries for 4 tokens"):
        build_batch([ScoredRollout(0, 1.0, [bad])], CFG)
    bad = _gen(2, 2, 1)
    bad.loss_mask = [0, 0, 2, 1]
    with pytest.raises(ValueError, match=r"loss_mask holds \[2\]; expected 0 or 1"):
        build_batch([ScoredRollout(0, 1.0, [bad])], CFG)
    with pytest.raises(ValueError, match="no recorded routing but rl.loss.router_replay is on"):
        build_batch([ScoredRollout(0, 1.0, [_gen(2, 2, 1, routing=False)])], CFG)
    bad = _gen(2, 2, 1)
    bad.routing = np.zeros((3, 2, 3), np.int32)
    with pytest.raises(ValueError, match=r"routing of shape \(3, 2, 3\) for 4 tokens; expected \[3 or 4, 2, 2\]"):
        build_batch([ScoredRollout(0, 1.0, [bad])], CFG)
