"""One `SamplerConfig` (config/sampler.py) behind every sampler surface: `serve`'s flags, the
learner's `rl.sampler` section and the replicas it starts, and `Sampler.from_config`."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import jax
import pytest

import composer_jax as cj
from composer_jax.checkpoint.manager import TrainCheckpointer
from composer_jax.config import CheckpointConfig, config_from_dict, to_dict
from composer_jax.config.sampler import (
    FLAGS,
    LEARNER_SAMPLER,
    SERVE_SAMPLER,
    SamplerConfig,
    add_sampler_flags,
    sampler_argv,
    sampler_from_args,
)
from composer_jax.inference.engine.batch_sampler import Sampler, SamplerSettings
from composer_jax.inference.server.cli import _serve_parser
from composer_jax.inference.server.policy import load_policy
from composer_jax.model.params import init_params
from composer_jax.rl.samplers.serve_launch import local_samplers
from composer_jax.sharding import ShardingRules, make_mesh
from composer_jax.train.state import init_train_state

TINY = Path(__file__).resolve().parents[3] / "configs" / "model" / "tiny.yaml"


def _parsed(argv: list[str]) -> SamplerConfig:
    p = argparse.ArgumentParser()
    add_sampler_flags(p)
    return sampler_from_args(p.parse_args(argv))


@pytest.mark.parametrize(
    "s",
    [
        SERVE_SAMPLER,
        LEARNER_SAMPLER,
        SamplerConfig(slots=3, max_queued=0, prefix_cache="keep", warm_up=True, poll_s=0.05),
        SamplerConfig(slots=1, max_queued=None, prefix_cache="none", warm_up=False, poll_s=7.25),
        SamplerConfig(compile_cache="runs/x/compile cache", admission_rows=1, decode_chunk=8),
    ],
)
def test_the_argv_a_replica_gets_parses_back_to_the_same_settings(s):
    assert _parsed(sampler_argv(s)) == s


def test_serve_defaults_are_the_classes_and_every_field_has_its_flag():
    args = _serve_parser().parse_args(["--checkpoint", "x"])
    assert sampler_from_args(args) == SamplerConfig() == SERVE_SAMPLER
    assert (SERVE_SAMPLER.slots, SERVE_SAMPLER.max_queued, SERVE_SAMPLER.poll_s) == (8, 64, 1.0)
    assert set(FLAGS) == {f for f in SamplerConfig.__dataclass_fields__}
    assert _parsed(["--max-queued", "none", "--warm-up"]) == SamplerConfig(max_queued=None, warm_up=True)


def test_a_bad_flag_value_names_the_flag(capsys):
    with pytest.raises(SystemExit):
        _parsed(["--max-queued", "-1"])
    assert "--max-queued: -1 must be >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _parsed(["--slots", "many"])
    assert "--slots: 'many' is not an integer" in capsys.readouterr().err


def test_a_partial_rl_sampler_section_keeps_the_learners_other_defaults():
    cfg = cj.load_config(TINY, ["rl.sampler.slots=4"], num_devices=None)
    assert cfg.rl.sampler == SamplerConfig(slots=4, max_queued=None, prefix_cache="version", poll_s=0.2)
    assert cj.load_config(TINY, [], num_devices=None).rl.sampler == LEARNER_SAMPLER


def test_the_learners_replicas_get_exactly_its_sampler_section(tmp_path):
    overrides = ["rl.sampler.slots=5", "rl.sampler.prefix_cache=keep", "rl.sampler.warm_up=true", "rl.local_samplers=1"]
    cfg = cj.load_config(TINY, overrides, num_devices=None)
    samplers = local_samplers(cfg, str(tmp_path), "file:///store", 3, tmp_path)
    argv = samplers._children[0].spec.argv("127.0.0.1", 4321)
    assert argv[0] == "serve"
    args = _serve_parser().parse_args(argv[1:])
    assert sampler_from_args(args) == cfg.rl.sampler
    assert (args.version, args.max_len, args.weights_from, args.port) == (3, cfg.train.seq_len, "file:///store", 4321)


def test_sampler_from_config_takes_slots_and_prefix_cache():
    cfg = cj.load_config(TINY, [], num_devices=None).model
    params = init_params(cfg, jax.random.key(0))
    s = Sampler.from_config(params, cfg, SamplerConfig(slots=3, prefix_cache="none"), max_len=16, version=2)
    assert (s.slots, s.settings.prefix_cache, s.version, s.compilations) == (3, "none", 2, 0)
    # a rebuilt sampler (after a failed step) has the same settings object, fresh state
    again = s.rebuilt(params, 5)
    assert (again.settings, again.version, again.busy) == (s.settings, 5, False)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"decode_chunk": 0}, "decode_chunk=0 must be >= 1"),
        ({"speculative_tokens": -1}, "speculative_tokens=-1 must be >= 0"),
        ({"draft_experts": 1}, "draft_experts=1 needs speculative_tokens >= 1"),
    ],
)
def test_sampler_settings_refuse_what_no_model_can_run(change, message):
    base = SamplerSettings(slots=2, max_len=16)
    with pytest.raises(ValueError, match=message):
        dataclasses.replace(base, **change)
    assert dataclasses.replace(base, decode_chunk=4).decode_chunk == 4 and base.decode_chunk == 1


def test_a_checkpoint_saved_with_the_earlier_rl_sampler_keys_still_serves(tmp_path):
    cfg = cj.load_config(TINY, ["mesh.fsdp=1"], num_devices=None)
    saved = to_dict(cfg)
    del saved["rl"]["sampler"]
    saved["rl"].update(sampler_slots=16, sampler_prefix_cache="keep", sampler_warm_up=False, sampler_poll_s=0.2)
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    state = init_train_state(cfg, mesh, ShardingRules.create(cfg.sharding_rules))
    with TrainCheckpointer(CheckpointConfig(directory=str(tmp_path), save_every=1)) as ck:
        ck.save(1, state, config=saved)
    with pytest.raises(cj.ConfigError, match="rl.sampler_slots is now rl.sampler.slots"):
        config_from_dict(saved, num_devices=None)
    policy = load_policy(tmp_path)
    assert policy.cfg == cfg.model and policy.step == 1
