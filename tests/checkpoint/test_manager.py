"""TrainCheckpointer: round trips, resharding, retention, async saves, corruption, compatibility.

Expected values come from the arrays that were saved (copied to numpy before saving) and from
retention sets worked out by hand, never from a second read of the checkpoint.
"""

import dataclasses
import logging
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import composer_jax as cj
from composer_jax.checkpoint.manager import TrainCheckpointer, restore_params_only
from composer_jax.checkpoint.validate import (
    CheckpointCorruptError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    ConfigMismatchError,
    NoGoodCheckpointError,
)
from composer_jax.config import ConfigError, to_dict
from composer_jax.config.checkpoint import CheckpointConfig
from composer_jax.model.params import abstract_params

TINY = Path(__file__).resolve().parents[2] / "configs/model/tiny.yaml"
TX = optax.adamw(1e-3)
DATA_STATE = {"shard": 3, "position": 12345, "mixture": {"code": 0.7, "text": 0.3}}


def mesh_of(**axes):
    n = int(np.prod(list(axes.values())))
    return cj.make_mesh(cj.MeshConfig(**{"fsdp": 1, **axes}), devices=jax.devices()[:n])


@pytest.fixture(scope="module")
def cfg():
    return cj.load_config(TINY, overrides=["model.num_layers=2", "model.vocab_size=128"])


def abstract_state(model_cfg, mesh):
    """Abstract train state on `mesh`: parameters by the sharding rules, optimiser moments like
    their parameters, scalars and the rng key replicated."""
    params = abstract_params(model_cfg, mesh)
    rep = NamedSharding(mesh, P())
    opt = optax.tree_map_params(
        TX,
        lambda a, p: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=p.sharding),
        jax.eval_shape(TX.init, params),
        params,
        transform_non_params=lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=rep),
    )
    return {
        "params": params,
        "opt_state": opt,
        "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=rep),
        "rng": jax.ShapeDtypeStruct((), jax.random.key(0).dtype, sharding=rep),
    }


@pytest.fixture(scope="module")
def saved_run(cfg, tmp_path_factory):
    """A realistic state (tiny MoE params, AdamW moments after one update, step, typed rng key)
    saved on fsdp=8 at step 7, plus numpy copies of every leaf."""
    mesh = mesh_of(fsdp=8)
    params = cj.init_params(cfg.model, jax.random.key(0), mesh)

    @jax.jit
    def one_update(params):
        # one step so the moments and count are not all zeros (a round trip of zeros proves little)
        opt = TX.init(params)
        grads = jax.tree.map(lambda p: jnp.sin(p * 100.0), params)
        updates, opt = TX.update(grads, opt, params)
        return optax.apply_updates(params, updates), opt

    params, opt = one_update(params)
    state = {"params": params, "opt_state": opt, "step": jnp.int32(7), "rng": jax.random.key(42)}
    expected = jax.tree.map(np.asarray, {**state, "rng": jax.random.key_data(state["rng"])})
    directory = tmp_path_factory.mktemp("run")
    ck = CheckpointConfig(directory=str(directory), save_every=1, keep_last=3)
    with TrainCheckpointer(ck) as ckpt:
        assert ckpt.save(7, state, data_state=DATA_STATE, config=to_dict(cfg), metrics={"loss": 2.5})
    return directory, ck, expected


def assert_state_equal(restored, expected, abstract):
    # orbax stores a typed key as its uint32 key data and re-wraps it as a typed key on restore
    assert jax.dtypes.issubdtype(restored["rng"].dtype, jax.dtypes.prng_key)
    got = {**restored, "rng": jax.random.key_data(restored["rng"])}
    flat_exp = dict(jax.tree_util.tree_leaves_with_path(expected))
    leaves = jax.tree_util.tree_leaves_with_path(got)
    assert len(leaves) == len(flat_exp)
    for path, leaf in leaves:
        np.testing.assert_array_equal(np.asarray(leaf), flat_exp[path], err_msg=jax.tree_util.keystr(path))
    for path, leaf in jax.tree_util.tree_leaves_with_path(restored):
        want = dict(jax.tree_util.tree_leaves_with_path(abstract))[path].sharding
        assert leaf.sharding.is_equivalent_to(want, leaf.ndim), jax.tree_util.keystr(path)


@pytest.mark.parametrize(
    "axes",
    [dict(fsdp=8), dict(data=2, fsdp=2, expert=2), dict(fsdp=1)],
    ids=["same-fsdp8", "data2-fsdp2-expert2", "one-device"],
)
def test_round_trip_and_reshard(cfg, saved_run, axes):
    directory, ck, expected = saved_run
    abstract = abstract_state(cfg.model, mesh_of(**axes))
    with TrainCheckpointer(ck) as ckpt:
        state, data_state, config, step = ckpt.restore(abstract, config=to_dict(cfg))
        assert ckpt.read_metrics(7) == {"loss": 2.5}
    assert step == 7
    assert data_state == DATA_STATE
    assert config == to_dict(cfg)
    assert_state_equal(state, expected, abstract)
    # the expert weights really are split over the expert axis when the new mesh has one
    gate = state["params"]["moe_layers"]["moe"]["gate"]
    assert ("expert" in str(gate.sharding.spec)) == (axes.get("expert", 1) > 1)


def test_retention_keep_last_and_keep_every(tmp_path):
    # Saving every step 1..10 with keep_last=2, keep_every=4:
    #   newest two: {9, 10};  multiples of 4: {4, 8}  ->  kept {4, 8, 9, 10}
    # (1, 2, 3, 5, 6, 7 are deleted as newer steps arrive.)
    ck = CheckpointConfig(directory=str(tmp_path), save_every=1, keep_last=2, keep_every=4, async_save=False)
    x = {"w": jnp.arange(4.0)}
    with TrainCheckpointer(ck) as ckpt:
        for s in range(1, 11):
            assert ckpt.save(s, x, config={})
        assert ckpt.all_steps() == [4, 8, 9, 10]
        assert ckpt.latest_step() == 10
    assert sorted(int(p.name) for p in tmp_path.iterdir() if p.name.isdigit()) == [4, 8, 9, 10]


def test_save_every_and_force(tmp_path):
    ck = CheckpointConfig(directory=str(tmp_path), save_every=5, keep_last=0)
    x = {"w": jnp.ones(3)}
    with TrainCheckpointer(ck) as ckpt:
        assert [s for s in range(1, 12) if ckpt.save(s, x, config={})] == [5, 10]
        assert ckpt.save(12, x, config={}, force=True)  # e.g. the last step of a stage
        assert not ckpt.save(12, x, config={}, force=True)  # already there: no error, no rewrite
        assert not ckpt.save(3, x, config={}, force=False)  # older than the latest: skipped
        ckpt.wait()
        assert ckpt.all_steps() == [5, 10, 12]


def test_async_save_copies_before_returning(tmp_path):
    ck = CheckpointConfig(directory=str(tmp_path), save_every=1, async_save=True)
    mesh = mesh_of(fsdp=8)
    sh = NamedSharding(mesh, P("fsdp"))
    x = {"w": jax.device_put(jnp.arange(64.0).reshape(16, 4), sh)}
    want = np.arange(64.0).reshape(16, 4)
    with TrainCheckpointer(ck) as ckpt:
        assert ckpt.save(1, x, config={"a": 1})
        # training goes on while the files are written: the buffers may be donated/freed now
        x["w"].delete()
        ckpt.wait()
        assert (ckpt.step_dir(1) / "commit_success.txt").exists()
        restored, _, config, _ = ckpt.restore({"w": jax.ShapeDtypeStruct((16, 4), jnp.float32, sharding=sh)})
    np.testing.assert_array_equal(np.asarray(restored["w"]), want)
    assert config == {"a": 1}


# --------------------------------------------------------------------------------------------------
# Corrupt checkpoints and fallback
# --------------------------------------------------------------------------------------------------


def _three_steps(tmp_path):
    ck = CheckpointConfig(directory=str(tmp_path), save_every=1, keep_last=0, async_save=False)
    sh = NamedSharding(mesh_of(fsdp=8), P("fsdp"))
    with TrainCheckpointer(ck) as ckpt:
        for s in (1, 2, 3):
            ckpt.save(s, {"w": jax.device_put(jnp.full((8, 2), float(s)), sh)}, data_state={"pos": s}, config={})
    return ck, {"w": jax.ShapeDtypeStruct((8, 2), jnp.float32, sharding=sh)}


def _array_files(step_dir):
    # OCDBT keeps array bytes in content-addressed files under `d/`
    return [p for p in (step_dir / "train_state" / "d").iterdir() if p.is_file()]


def _delete_data(step_dir):
    for f in _array_files(step_dir):
        f.unlink()


def _truncate_data(step_dir):
    for f in _array_files(step_dir):
        with open(f, "r+b") as fh:
            fh.truncate(os.path.getsize(f) // 2)


def _remove_commit_marker(step_dir):
    (step_dir / "commit_success.txt").unlink()


def _remove_tree_metadata(step_dir):
    (step_dir / "train_state" / "_METADATA").unlink()


CORRUPTIONS = [_delete_data, _truncate_data, _remove_commit_marker, _remove_tree_metadata]


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__.strip("_"))
def test_corrupt_latest_falls_back_with_warning(tmp_path, caplog, corrupt):
    ck, abstract = _three_steps(tmp_path)
    corrupt(tmp_path / "3")
    with TrainCheckpointer(ck) as ckpt, caplog.at_level(logging.WARNING):
        state, data_state, _, step = ckpt.restore(abstract)
        assert step == 2 and data_state == {"pos": 2}
        np.testing.assert_array_equal(np.asarray(state["w"]), np.full((8, 2), 2.0))
        assert any("step 3" in r.getMessage() and "falling back" in r.getMessage() for r in caplog.records)
        # the bad step is moved aside, so the run can save step 3 again
        assert ckpt.all_steps() == [1, 2]
        assert (tmp_path / "quarantine" / "3").is_dir()
        assert ckpt.save(3, {"w": state["w"]}, config={})


@pytest.mark.parametrize("corrupt", CORRUPTIONS, ids=lambda f: f.__name__.strip("_"))
def test_corrupt_without_fallback_names_path_and_step(tmp_path, corrupt):
    ck, abstract = _three_steps(tmp_path)
    corrupt(tmp_path / "3")
    with TrainCheckpointer(ck) as ckpt:
        with pytest.raises(CheckpointCorruptError) as err:
            ckpt.restore(abstract, fallback=False)
        assert err.value.step == 3 and str(tmp_path / "3") in str(err.value)
        assert "step 3" in str(err.value)
        assert ckpt.all_steps() == [1, 2, 3]  # nothing moved without fallback
    print(err.value)


def test_all_corrupt_lists_every_attempt(tmp_path):
    ck, abstract = _three_steps(tmp_path)
    _remove_commit_marker(tmp_path / "3")
    _truncate_data(tmp_path / "2")
    _delete_data(tmp_path / "1")
    with TrainCheckpointer(ck) as ckpt:
        with pytest.raises(NoGoodCheckpointError) as err:
            ckpt.restore(abstract)
        assert [s for s, _ in err.value.attempts] == [3, 2, 1]
        assert ckpt.all_steps() == [1, 2, 3]  # nothing restored, so nothing moved
    text = str(err.value)
    assert "commit_success.txt" in text and "step 2" in text and "step 1" in text


def test_missing_checkpoint_errors(tmp_path):
    ck, abstract = _three_steps(tmp_path)
    with TrainCheckpointer(ck) as ckpt:
        with pytest.raises(CheckpointNotFoundError, match=r"step 9 .*saved steps: \[1, 2, 3\]"):
            ckpt.restore(abstract, step=9)
        state, _, _, step = ckpt.restore(abstract, step=2)
        assert step == 2
    with TrainCheckpointer(dataclasses.replace(ck, directory=str(tmp_path / "empty"))) as ckpt:
        assert ckpt.latest_step() is None
        with pytest.raises(CheckpointNotFoundError, match="no checkpoints"):
            ckpt.restore(abstract)


# --------------------------------------------------------------------------------------------------
# Structure and config compatibility
# --------------------------------------------------------------------------------------------------


def test_structure_and_shape_mismatch_are_named(tmp_path):
    ck, abstract = _three_steps(tmp_path)
    sh = abstract["w"].sharding
    extra = {**abstract, "bias": jax.ShapeDtypeStruct((2,), jnp.float32, sharding=NamedSharding(sh.mesh, P()))}
    reshaped = {"w": jax.ShapeDtypeStruct((8, 4), jnp.float32, sharding=sh)}
    recast = {"w": jax.ShapeDtypeStruct((8, 2), jnp.bfloat16, sharding=sh)}
    with TrainCheckpointer(ck) as ckpt:
        with pytest.raises(CheckpointMismatchError, match=r"not in the checkpoint: bias"):
            ckpt.restore(extra, fallback=False)
        with pytest.raises(CheckpointMismatchError, match=r"w: saved shape \(8, 2\), requested \(8, 4\)"):
            ckpt.restore(reshaped, fallback=False)
        with pytest.raises(CheckpointMismatchError, match=r"w: saved dtype float32, requested bfloat16"):
            ckpt.restore(recast, fallback=False)
        # with fallback every step mismatches: the error lists them all and nothing is moved
        with pytest.raises(NoGoodCheckpointError, match=r"step 3: .*\n.*step 2: .*\n.*step 1: "):
            ckpt.restore(extra)
        assert ckpt.all_steps() == [1, 2, 3]


def test_config_compatibility(cfg, saved_run):
    directory, ck, expected = saved_run
    abstract = abstract_state(cfg.model, mesh_of(fsdp=8))
    changed = to_dict(cfg)
    changed["model"] = {
        **changed["model"],
        "num_experts": 16,
        "rope_scaling": {**changed["model"]["rope_scaling"], "type": "yarn", "factor": 4.0},
    }
    with TrainCheckpointer(ck) as ckpt:
        with pytest.raises(ConfigMismatchError) as err:
            ckpt.restore(abstract, config=changed)
        msg = str(err.value)
        assert "model.num_experts: saved 8, now 16" in msg
        assert "model.rope_scaling.factor: saved 1.0, now 4.0" in msg and "step 7" in msg
        assert ckpt.all_steps() == [7]  # a config mismatch never falls back or moves anything
        # a new stage may change the context extension, but not the number of experts
        with pytest.raises(ConfigMismatchError, match="num_experts") as err:
            ckpt.restore(abstract, config=changed, allow_config_changes=["model.rope_scaling"])
        assert "rope_scaling" not in str(err.value).split(". If")[0]
        changed["model"]["num_experts"] = 8
        state, *_ = ckpt.restore(abstract, config=changed, allow_config_changes=["model.rope_scaling"])
    assert_state_equal(state, expected, abstract)


def test_restore_params_only_for_next_stage(cfg, saved_run):
    directory, _, expected = saved_run
    mesh = mesh_of(data=2, fsdp=2, expert=2)
    target = abstract_params(cfg.model, mesh)
    next_stage = to_dict(cfg)
    next_stage["model"] = {**next_stage["model"], "max_position_embeddings": 16384}
    for where in (directory, directory / "7"):  # the run's root, or one step's directory
        params = restore_params_only(
            where, target, config=next_stage, allow_config_changes=["model.max_position_embeddings"]
        )
        for path, leaf in jax.tree_util.tree_leaves_with_path(params):
            np.testing.assert_array_equal(
                np.asarray(leaf), dict(jax.tree_util.tree_leaves_with_path(expected["params"]))[path]
            )
            assert leaf.sharding == dict(jax.tree_util.tree_leaves_with_path(target))[path].sharding
    with pytest.raises(ConfigMismatchError, match="max_position_embeddings"):
        restore_params_only(directory, target, config=next_stage)
    with pytest.raises(CheckpointMismatchError, match="no 'weights' sub-tree"):
        restore_params_only(directory, target, params_key="weights")


def test_save_rejects_non_json_state_and_bad_config(tmp_path):
    ck = CheckpointConfig(directory=str(tmp_path), save_every=1)
    with TrainCheckpointer(ck) as ckpt:
        with pytest.raises(TypeError, match="data_state must be JSON-serialisable"):
            ckpt.save(1, {"w": jnp.ones(2)}, data_state={"rng": object()}, config={})
        assert ckpt.all_steps() == []
    with pytest.raises(ConfigError, match=r"checkpoint.keep_last=-1"):
        CheckpointConfig(directory="x", keep_last=-1)
    with pytest.raises(ConfigError, match=r"keep_every=150 is not a multiple of checkpoint.save_every=100"):
        CheckpointConfig(directory="x", save_every=100, keep_every=150)
    with pytest.raises(ValueError, match="checkpoint.directory is empty"):
        TrainCheckpointer(CheckpointConfig())
