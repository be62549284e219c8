"""On the fake 8-device mesh the sharded forward and gradient equal the single-device ones."""

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import composer_jax as cj
from composer_jax.sharding import ShardingRules

MESHES = [
    # full suite only: tests/train/test_step_sharded.py's data2-fsdp2-expert2-ctx1 case checks the
    # same mesh's forward and gradient through the train step in the default suite
    pytest.param(dict(data=2, fsdp=2, expert=2, context=1, tensor=1), marks=pytest.mark.slow),
    dict(data=1, fsdp=2, expert=2, context=1, tensor=2),
    # full suite only: the tensor axis is the case above's, the data axis data2-fsdp2-expert2-ctx1's in
    # tests/train/test_step_sharded.py (both default)
    pytest.param(dict(data=2, fsdp=1, expert=1, context=1, tensor=4), marks=pytest.mark.slow),
]


@pytest.fixture(scope="module")
def setup():
    cfg = cj.load_config(Path(__file__).resolve().parents[2] / "configs/model/tiny.yaml")
    m = cfg.model
    params = cj.init_params(m, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (8, 16), 0, m.vocab_size)
    # packed rows: segments of lengths 5, 7, 4 in every row
    seg = jnp.tile(jnp.array([1] * 5 + [2] * 7 + [3] * 4, jnp.int32), (8, 1))
    return m, params, tokens, seg


def _loss(params, tokens, seg, m):
    out = cj.forward(params, tokens, m, segment_ids=seg)
    lp = jax.nn.log_softmax(out.logits[:, :-1])
    nll = -jnp.take_along_axis(lp, tokens[:, 1:, None], -1).mean()
    mtp = jax.nn.log_softmax(out.mtp_logits[0, :, :-2])
    return nll - 0.3 * jnp.take_along_axis(mtp, tokens[:, 2:, None], -1).mean()


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "-".join(f"{k}{v}" for k, v in s.items() if v > 1))
def test_sharded_forward_and_grad_equal_single_device(setup, shape):
    m, params, tokens, seg = setup
    ref_out = jax.jit(lambda p, t, s: cj.forward(p, t, m, segment_ids=s))(params, tokens, seg)
    ref_grad = jax.jit(jax.grad(_loss), static_argnums=3)(params, tokens, seg, m)

    mesh = cj.make_mesh(cj.MeshConfig(**shape))
    sharded = cj.init_params(m, jax.random.key(0), mesh)
    # parameters really are sharded as the rules say (experts over the expert axis, ...)
    gate = sharded["moe_layers"]["moe"]["gate"]
    assert gate.sharding.spec == ShardingRules.create().spec(
        ("layers", "experts", "embed", "expert_mlp"), gate.shape, mesh
    )
    with jax.set_mesh(mesh):
        out = jax.jit(lambda p, t, s: cj.forward(p, t, m, segment_ids=s))(sharded, tokens, seg)
        grad = jax.jit(jax.grad(_loss), static_argnums=3)(sharded, tokens, seg, m)
    np.testing.assert_allclose(out.logits, ref_out.logits, atol=2e-5)
    np.testing.assert_allclose(out.mtp_logits, ref_out.mtp_logits, atol=2e-5)
    np.testing.assert_array_equal(out.routing, ref_out.routing)
    np.testing.assert_array_equal(out.aux["expert_counts"], ref_out.aux["expert_counts"])
    flat_ref = jax.tree_util.tree_leaves_with_path(ref_grad)
    flat = dict(jax.tree_util.tree_leaves_with_path(grad))
    for path, g in flat_ref:
        np.testing.assert_allclose(
            np.asarray(flat[path]), np.asarray(g), atol=2e-6, rtol=1e-4, err_msg=jax.tree_util.keystr(path)
        )


def test_init_is_sharding_independent_and_eval_shape_allocates_nothing(setup):
    m, params, _, _ = setup
    mesh = cj.make_mesh(cj.MeshConfig(data=1, fsdp=2, expert=2, context=1, tensor=2))
    before = len(jax.live_arrays())
    shapes = jax.eval_shape(lambda k: cj.init_params(m, k, mesh), jax.random.key(0))
    assert all(isinstance(x, jax.ShapeDtypeStruct) for x in jax.tree.leaves(shapes))
    assert len(jax.live_arrays()) == before
    sharded = cj.init_params(m, jax.random.key(0), mesh)
    for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_router_replay_through_forward(setup):
    m, params, tokens, seg = setup
    out = cj.forward(params, tokens, m, segment_ids=seg)
    again = cj.forward(params, tokens, m, segment_ids=seg, routing=out.routing)
    np.testing.assert_allclose(again.logits, out.logits, atol=1e-6)
    # replaying a different selection changes the output and is reported back unchanged
    other = (out.routing + 1) % m.num_experts
    changed = cj.forward(params, tokens, m, segment_ids=seg, routing=other)
    np.testing.assert_array_equal(changed.routing, other)
    assert float(jnp.abs(changed.logits - out.logits).max()) > 1e-4


def test_packed_segments_do_not_attend_across(setup):
    m, params, tokens, seg = setup
    packed = cj.forward(params, tokens[:1], m, segment_ids=seg[:1]).logits[0]
    # the second segment (positions 5..11) alone, as its own sequence
    alone = cj.forward(params, tokens[:1, 5:12], m).logits[0]
    np.testing.assert_allclose(packed[5:12], alone, atol=1e-5)


def test_unrolled_layers_equal_scanned(setup):
    import dataclasses

    m, params, tokens, seg = setup
    scanned = cj.forward(params, tokens, m, segment_ids=seg)
    unrolled = cj.forward(params, tokens, dataclasses.replace(m, scan_layers=False), segment_ids=seg)
    np.testing.assert_allclose(unrolled.logits, scanned.logits, atol=1e-5)
    np.testing.assert_allclose(unrolled.mtp_logits, scanned.mtp_logits, atol=1e-5)
    np.testing.assert_array_equal(unrolled.routing, scanned.routing)
