"""Config validation in one shape: each section's `validate_<section>` at load, the checks across
sections in config/run.py (`check_sections` at load, `check_rl_run` for the RL learner, which
takes the process count and the usable cores as arguments: config/ imports no JAX)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

import composer_jax as cj
from composer_jax.config import (
    ConfigError,
    DataConfigError,
    MeshConfig,
    TrainConfig,
    check_rl_run,
    check_sections,
    validate_mesh,
    validate_sections,
    validate_train,
)
from composer_jax.config.rl import replica_cores

TINY = str(Path(__file__).resolve().parents[2] / "configs/model/tiny.yaml")
RL = ["rl.tasks=[t]", "rl.group_size=4", "train.batch_size=8", "train.seq_len=64", "agent.max_turn_tokens=16"]


def _rl(*over: str) -> cj.Config:
    given = {o.split("=", 1)[0] for o in over}
    return cj.load_config(TINY, [*(o for o in RL if o.split("=", 1)[0] not in given), *over], num_devices=None)


def test_sections_validate_their_own_fields_at_load():
    # data: checked at load (no sources needed there: only what reads documents needs them)
    with pytest.raises(DataConfigError, match=r"data.shuffle_window=-1 must be >= 0"):
        cj.load_config(TINY, ["data.shuffle_window=-1"], num_devices=None)
    cfg = cj.load_config(TINY, num_devices=None)
    assert cfg.data.sources == ()
    validate_sections(cfg)
    with pytest.raises(ConfigError, match=r"mesh.tensor=0 must be a positive integer or -1"):
        validate_mesh(MeshConfig(tensor=0))
    with pytest.raises(ConfigError, match=r"train.optimizer.lr=0.0 must be > 0"):
        validate_train(dataclasses.replace(TrainConfig(), optimizer=dataclasses.replace(cfg.train.optimizer, lr=0.0)))
    # a section's check reads that section only: a sequence the context axis cannot split is a
    # check across sections
    long_ctx = dataclasses.replace(cfg, mesh=MeshConfig(fsdp=2, context=4), train=TrainConfig(seq_len=12))
    validate_train(long_ctx.train)
    with pytest.raises(ConfigError, match=r"train.seq_len=12 must be divisible by 2 x mesh.context=8"):
        check_sections(long_ctx, 8)
    check_sections(long_ctx, None)  # the mesh unresolved: nothing to hold it against


@pytest.mark.parametrize(
    "over, process_count, cores, message",
    [
        (["rl.tasks=[]"], 1, {0}, r"rl.tasks is empty; give the task ids \(or gen/FAMILY\) to train on"),
        (["train.batch_size=2"], 1, {0}, r"train.batch_size=2 rows cannot hold one group of rl.group_size=4"),
        (["agent.max_turn_tokens=64"], 1, {0}, r"agent.max_turn_tokens=64 must be below train.seq_len=64"),
        (
            [],
            2,
            {0},
            r"a trainer of 2 processes samples through `composer-jax serve` replicas: give rl.sampler_urls",
        ),
        (
            ["rl.local_samplers=1", "rl.pin_cores=true"],
            3,
            {0, 1},
            r"rl.pin_cores=true pins a one-process trainer .*; this trainer has 3 processes: "
            r"accepted rl.pin_cores=false",
        ),
        (["rl.pin_cores=true"], 1, {0, 1}, r"with rl.local_samplers=0 there is nothing to pin apart"),
        (
            ["rl.pin_cores=true", "rl.local_samplers=2"],
            1,
            {5, 3},
            r"rl.pin_cores with rl.local_samplers=2 needs 3 cores \(one for the trainer, one per replica\); "
            r"this process may use 2: \[3, 5\]",
        ),
        (
            ["rl.pin_cores=true", "rl.pin_trainer=false", "rl.local_samplers=3"],
            1,
            {5, 3},
            r"rl.pin_cores with rl.local_samplers=3 needs 3 cores \(one per replica; rl.pin_trainer=false\); "
            r"this process may use 2: \[3, 5\]",
        ),
        (
            ["rl.groups_per_step=2", "rl.queue_size=1"],
            1,
            {0},
            r"rl.queue_size=1 cannot hold one step's rl.groups_per_step=2 groups",
        ),
    ],
)
def test_rl_run_checks_name_the_keys(over, process_count, cores, message):
    with pytest.raises(ConfigError, match=message):
        check_rl_run(_rl(*over), process_count=process_count, cores=cores)


def test_rl_run_checks_pass_and_read_the_job():
    check_rl_run(_rl("rl.groups_per_step=2", "rl.queue_size=2"), process_count=1, cores={0})
    # pinned: as many cores as the trainer and its replicas, read from the argument
    check_rl_run(_rl("rl.pin_cores=true", "rl.local_samplers=2"), process_count=1, cores={0, 1, 2})
    # the trainer on every core: one core per replica is enough
    check_rl_run(_rl("rl.pin_cores=true", "rl.pin_trainer=false", "rl.local_samplers=2"), process_count=1, cores={0, 1})
    # several processes sample through replicas
    check_rl_run(_rl("rl.local_samplers=1"), process_count=2, cores={0})
    check_rl_run(_rl("rl.sampler_urls=[http://h:1]", "rl.weight_store=file:///x"), process_count=4, cores=set())
    # a config changed after load is checked as well (train.micro_batches does not divide the batch)
    cfg = _rl()
    bad = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batches=3))
    with pytest.raises(ConfigError, match=r"train.batch_size=8 must be divisible by train.micro_batches=3"):
        check_rl_run(bad, process_count=1, cores={0})


def test_accepted_name_sets_are_written_once():
    """Each set is the config field's Literal; the tuples other modules test against are it."""
    import typing

    from composer_jax.config import data, model, rl
    from composer_jax.model.moe import expert_parallel
    from composer_jax.quant import recipe

    hints = typing.get_type_hints(model.ModelConfig)
    assert recipe.RECIPES == typing.get_args(hints["moe_precision"]) == model.MOE_PRECISIONS
    assert recipe.BACKENDS == typing.get_args(hints["moe_quant_backend"])
    assert ("auto", *expert_parallel.EXCHANGES) == typing.get_args(hints["moe_ep_exchange"])
    assert model.DTYPES == typing.get_args(hints["param_dtype"]) == typing.get_args(hints["compute_dtype"])
    assert rl.ADVANTAGE_ESTIMATORS == typing.get_args(typing.get_type_hints(rl.RLLossConfig)["advantage"])
    assert rl.AGGREGATIONS == typing.get_args(typing.get_type_hints(rl.RLLossConfig)["aggregation"])
    assert rl.LENGTH_MEASURES == typing.get_args(typing.get_type_hints(rl.LengthPenaltyConfig)["x"])
    assert data.SOURCE_TYPES == typing.get_args(typing.get_type_hints(data.SourceConfig)["type"])
    assert data.FORMATS == typing.get_args(typing.get_type_hints(data.DataConfig)["format"])
    built = dataclasses.replace(model.ModelConfig(), moe_ep_exchange="x")
    with pytest.raises(ConfigError, match=r"model.moe_ep_exchange='x' is not accepted; accepted: auto, padded, "):
        model.validate_model(built)


@pytest.mark.parametrize(
    "over, cores, expected",
    [
        ([], {0, 1}, None),  # nothing pinned
        (["rl.pin_cores=true", "rl.local_samplers=1"], {7, 3}, [7]),  # the first (3) is the trainer's
        (["rl.pin_cores=true", "rl.local_samplers=2"], {0, 1, 2}, [1, 2]),
        (["rl.pin_cores=true", "rl.pin_trainer=false", "rl.local_samplers=2"], {7, 3}, [3, 7]),
        (["rl.pin_cores=true", "rl.pin_trainer=false", "rl.local_samplers=1"], {0, 1}, [0]),
    ],
)
def test_replica_cores_by_hand(over, cores, expected):
    assert replica_cores(_rl(*over).rl, cores) == expected


def test_pin_trainer_must_be_a_boolean():
    with pytest.raises(ConfigError, match=r"rl.pin_trainer=2: expected a boolean \(true/false\)"):
        _rl("rl.pin_trainer=2")


def test_env_grade_cache_is_a_count_of_verdicts():
    assert _rl().rl.env_grade_cache == 0  # off unless asked
    assert _rl("rl.env_grade_cache=64").rl.env_grade_cache == 64
    with pytest.raises(ConfigError, match=r"rl.env_grade_cache=-1: expected an integer >= 0"):
        _rl("rl.env_grade_cache=-1")
