"""The sharded training step equals the single-device step: loss, metrics and gradients, for meshes
using each of data, fsdp, expert, context (and combinations), on packed inputs, with MTP
self-distillation, the sequence balance loss and micro-batching."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import composer_jax as cj
from composer_jax.model.context_parallel import zigzag_permutation
from composer_jax.model.masks import segment_positions
from composer_jax.sharding import MeshRules, ShardingRules
from composer_jax.train.step import batch_gradients

TINY = Path(__file__).resolve().parents[2] / "configs/model/tiny.yaml"
COMMON = [
    "train.batch_size=8",
    "train.seq_len=32",
    "train.mtp_loss=self_distill",
    "train.seq_balance_loss=0.01",
    "train.z_loss=0.001",
]
# every axis appears, alone with one other or in combination (each mesh costs a compile of the
# whole gradient program, so the pure single-axis meshes are covered by these combinations)
MESHES = {
    "expert4-data2": dict(data=2, fsdp=1, expert=4, context=1, tensor=1),
    "context4-fsdp2": dict(data=1, fsdp=2, expert=1, context=4, tensor=1),
    "data2-fsdp2-expert2-ctx1": dict(data=2, fsdp=2, expert=2, context=1, tensor=1),
    "fsdp2-expert2-context2": dict(data=1, fsdp=2, expert=2, context=2, tensor=1),
    # the real stages' ZeRO-3 rules (configs/pretrain/stage1_32k.yaml): parameters and moments
    # split over fsdp x context x data, not over fsdp alone
    "fsdp2-expert2-context2-zero3": dict(data=1, fsdp=2, expert=2, context=2, tensor=1),
}
RULES = {"fsdp2-expert2-context2-zero3": {"embed": ["fsdp", "context", "data"], "lora_in": ["fsdp", "context", "data"]}}


def _batch():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, 512, (8, 32)).astype(np.int32)
    # packed rows with uneven segments and trailing padding; an SFT-like mask on some tokens
    lens = [[5, 11, 9, 7], [32], [3, 3, 20, 6], [16, 10, 6], [1, 30, 1], [8, 8, 8, 4], [12, 12, 8], [31, 1]]
    seg = np.zeros((8, 32), np.int32)
    for r, ls in enumerate(lens):
        start = 0
        for i, n in enumerate(ls):
            seg[r, start : start + n] = i + 1
            start += n
    seg[3, 28:] = 0
    mask = (rng.random((8, 32)) > 0.2).astype(np.float32) * (seg > 0)
    pos = np.asarray(segment_positions(jnp.asarray(seg)))
    return {"tokens": tokens, "segment_ids": seg, "positions": pos, "loss_mask": mask}


@pytest.fixture(scope="module")
def reference():
    cfg = cj.load_config(TINY, COMMON, num_devices=8)
    params = cj.init_params(cfg.model, jax.random.key(0))
    batch = _batch()
    obj, grads, sums, _ = jax.jit(lambda p, b: batch_gradients(p, b, cfg))(params, batch)
    return cfg, params, batch, obj, grads, sums


def _assert_same(obj, grads, sums, ref_obj, ref_grads, ref_sums):
    np.testing.assert_allclose(float(obj), float(ref_obj), rtol=2e-6)
    for k in ("nll", "z_loss", "tokens", "correct", "mtp_kl", "mtp_nll", "expert_counts", "seq_balance"):
        np.testing.assert_allclose(np.asarray(sums[k]), np.asarray(ref_sums[k]), rtol=2e-5, atol=1e-5, err_msg=k)
    flat = dict(jax.tree_util.tree_leaves_with_path(grads))
    for path, g in jax.tree_util.tree_leaves_with_path(ref_grads):
        np.testing.assert_allclose(
            np.asarray(flat[path]), np.asarray(g), atol=3e-6, rtol=2e-4, err_msg=jax.tree_util.keystr(path)
        )


# in the full suite only: fsdp2-expert2-context2 (its mesh is also the zero3 case's, under other rules) and
# expert4-data2 (data x expert is data2-fsdp2-expert2-ctx1's, which keeps the property by default)
SLOW = {"fsdp2-expert2-context2", "expert4-data2"}


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n in SLOW else n for n in MESHES])
def test_sharded_step_gradients_equal_single_device(reference, name):
    cfg, params, batch, ref_obj, ref_grads, ref_sums = reference
    mesh = cj.make_mesh(cj.MeshConfig(**MESHES[name]))
    rules = ShardingRules.create(RULES.get(name))
    sharded = cj.init_params(cfg.model, jax.random.key(0), mesh, rules)
    if name in RULES:  # the rules really split the model dimension over context too
        assert sharded["embed"].sharding.spec == P(None, ("fsdp", "context"))
    with jax.set_mesh(mesh):
        obj, grads, sums, _ = jax.jit(lambda p, b: batch_gradients(p, b, cfg, MeshRules(mesh, rules)))(sharded, batch)
    _assert_same(obj, grads, sums, ref_obj, ref_grads, ref_sums)


def test_micro_batches_equal_full_batch(reference):
    cfg, params, batch, ref_obj, ref_grads, ref_sums = reference
    cfg4 = cj.load_config(TINY, COMMON + ["train.micro_batches=4"], num_devices=8)
    obj, grads, sums, _ = jax.jit(lambda p, b: batch_gradients(p, b, cfg4))(params, batch)
    _assert_same(obj, grads, sums, ref_obj, ref_grads, ref_sums)


def test_zigzag_layout():
    # seq 8 over 2 context devices: chunks of 2 -> device 0 holds chunks 0 and 3, device 1 chunks 1, 2
    assert zigzag_permutation(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert zigzag_permutation(6, 1).tolist() == list(range(6))
