"""The `rl` config section: loaded from YAML keys and overrides, and every bad value rejected with
the key, the value and what is accepted."""

from __future__ import annotations

from pathlib import Path

import pytest

import composer_jax as cj
from composer_jax.config import ConfigError, LengthPenaltyConfig, RLLossConfig

TINY = Path(__file__).resolve().parents[2] / "configs" / "model" / "tiny.yaml"


def test_overrides_reach_the_rl_section():
    cfg = cj.load_config(
        TINY,
        [
            "rl.loss.advantage=grpo",
            "rl.loss.aggregation=token_mean",
            "rl.loss.clip_eps_low=0.2",
            "rl.loss.clip_eps_high=0.28",
            "rl.loss.plausibility_band=[0.5, 2]",
            "rl.loss.kl_coef=0.001",
            "rl.reward.length_penalty.q=1.5",
            "rl.reward.length_penalty.x=turns",
            "rl.reward.style_penalty=0.01",
        ],
        num_devices=None,
    )
    loss = cfg.rl.loss
    assert (loss.advantage, loss.aggregation) == ("grpo", "token_mean")
    assert (loss.clip_eps_low, loss.clip_eps_high) == (0.2, 0.28)
    assert loss.plausibility_band == (0.5, 2.0) and loss.kl_coef == 0.001 and loss.router_replay
    assert cfg.rl.reward.length_penalty == LengthPenaltyConfig(weight=0.0, k=0.01, q=1.5, x="turns")
    assert cfg.rl.reward.style_penalty == 0.01
    # a pretraining config has the defaults: Dr. GRPO, token sum, no clipping, no KL, no band
    plain = cj.load_config(TINY, num_devices=None).rl.loss
    assert plain == RLLossConfig() and plain.advantage == "drgrpo" and plain.aggregation == "token_sum"
    tis = cj.load_config(TINY, ["rl.loss.importance=tis", "rl.loss.importance_cap=2"], num_devices=None).rl.loss
    assert (tis.importance, tis.importance_cap) == ("tis", 2.0)


@pytest.mark.parametrize(
    "override, message",
    [
        ("rl.loss.advantage=ppo", r"rl.loss.advantage='ppo' is not accepted; accepted: one of 'drgrpo', 'grpo'"),
        ("rl.loss.aggregation=mean", r"rl.loss.aggregation='mean' is not accepted; accepted: one of 'token_sum'"),
        ("rl.loss.normalizer=-1", r"rl.loss.normalizer=-1.0: expected a number >= 0.0"),
        ("rl.loss.clip_eps_low=0", r"rl.loss.clip_eps_low=0.0: expected a number > 0.0"),
        ("rl.loss.clip_eps_low=1.5", r"rl.loss.clip_eps_low=1.5: expected a number in \(0, 1\)"),
        ("rl.loss.kl_coef=-0.1", r"rl.loss.kl_coef=-0.1: expected a number >= 0.0"),
        ("rl.loss.plausibility_band=[2, 3]", r"band=\[2.0, 3.0\]: expected \[lo, hi\] with 0 <= lo < 1 < hi"),
        ("rl.loss.plausibility_band=[0.5]", r"plausibility_band=\[0.5\]: expected \[lo, hi\] with 0 <= lo < 1 < hi"),
        ("rl.loss.temperature=0", r"rl.loss.temperature=0.0: expected a number > 0.0"),
        ("rl.loss.importance=is", r"rl.loss.importance='is': expected one of 'none', 'band', 'tis', 'icepop' or"),
        ("rl.loss.importance=icepop", r"rl.loss.importance='icepop' needs rl.loss.importance_cap: C > 1"),
        ("rl.reward.length_penalty.x=chars", r"x='chars' is not accepted; accepted: one of 'tokens', 'turns'"),
        ("rl.reward.length_penalty.k=0", r"rl.reward.length_penalty.k=0.0: expected a number > 0.0"),
        ("rl.reward.style_penalty=-1", r"rl.reward.style_penalty=-1.0: expected a number >= 0.0"),
        ("rl.staleness_unit=step", r"rl.staleness_unit='step' is not accepted; accepted: one of 'token', 'group'"),
        ("rl.max_staleness=-1", r"rl.max_staleness=-1: expected an integer >= 0"),
        (
            "rl.sampler.prefix_cache=always",
            r"rl.sampler.prefix_cache='always' is not accepted; accepted: one of 'none', 'version', 'keep'",
        ),
        ("rl.sampler_slots=4", r"rl.sampler_slots is now rl.sampler.slots: give rl.sampler.slots=4 instead"),
        ("rl.sampler.slots=0", r"rl.sampler.slots=0: expected an integer >= 1"),
        ("rl.sampler.max_queued=-1", r"rl.sampler.max_queued=-1: expected an integer >= 0, or null for no bound"),
        ("rl.sampler.poll_s=0", r"rl.sampler.poll_s=0.0: expected seconds > 0"),
        ("rl.sampler.warm_up=3", r"rl.sampler.warm_up=3: expected a boolean"),
        ("rl.queue_size=-2", r"rl.queue_size=-2: expected an integer >= 0"),
        ("rl.max_groups_in_flight=true", r"rl.max_groups_in_flight=True: expected an integer"),
        ("rl.weight_store=/tmp/w", r"rl.weight_store='/tmp/w': expected a tensorstore kvstore URL"),
        ("rl.loss.clip_eps=0.2", r"unknown key 'rl.loss.clip_eps' \(did you mean 'clip_eps_low'\?\)"),
    ],
)
def test_bad_values_name_key_value_and_accepted(override, message):
    with pytest.raises(ConfigError, match=message):
        cj.load_config(TINY, [override], num_devices=None)


def test_learner_refuses_a_queue_smaller_than_a_step():
    from composer_jax.rl.learner import check_config

    over = ["rl.tasks=[t]", "rl.group_size=4", "train.batch_size=8", "train.seq_len=64", "agent.max_turn_tokens=16"]
    check_config(cj.load_config(TINY, [*over, "rl.groups_per_step=2", "rl.queue_size=2"], num_devices=None))
    with pytest.raises(ConfigError, match=r"rl.queue_size=1 cannot hold one step's rl.groups_per_step=2 groups"):
        check_config(cj.load_config(TINY, [*over, "rl.groups_per_step=2", "rl.queue_size=1"], num_devices=None))


def test_a_fresh_run_refuses_a_weight_store_holding_another_runs_versions(tmp_path, monkeypatch):
    import numpy as np

    from composer_jax.rl.learner import run_rl
    from composer_jax.weightsync.publisher import WeightPublisher

    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(repo)
    url = f"file://{tmp_path / 'weights'}"
    for v in range(3):
        WeightPublisher(url).publish({"w": np.full((4,), v, np.float32)}, v)
    cfg = cj.load_config(
        "tests/rl/fixtures/rl_pick.yaml", [f"train.out_dir={tmp_path / 'run'}", f"rl.weight_store={url}"]
    )
    with pytest.raises(ConfigError, match=r"rl.weight_store=.* holds versions \[0, 1, 2\]..2 that are not this run's"):
        run_rl(cfg, echo=lambda _: None)
