"""The Flax NNX module (`model/nnx.py`) is `forward` over the same parameters: equal outputs,
`nnx.split`/`nnx.merge` round trip, flax's partition specs equal to the project's shardings on the
fake 8-device mesh, and `nnx.grad` equal to `jax.grad` of the pure function's loss."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import composer_jax as cj
from composer_jax.model.nnx import ComposerTransformer, RouterBias
from composer_jax.model.params import gradient_free_mask, param_shardings
from composer_jax.sharding import MeshRules, ShardingRules

# configs/model/tiny.yaml: MLA with query LoRA, a dense layer then MoE layers, one MTP depth
CFG = dataclasses.replace(
    cj.load_config(str(Path(__file__).resolve().parents[2] / "configs/model/tiny.yaml")).model,
    max_position_embeddings=64,
)


def _tokens(cfg, shape=(2, 8)):
    return jax.random.randint(jax.random.key(3), shape, 0, cfg.vocab_size, jnp.int32)


def _loss(out, tokens):
    logp = jax.nn.log_softmax(out.logits[:, :-1], axis=-1)
    nll = -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()
    return nll + 0.1 * jnp.mean(out.mtp_logits**2)


def _plain(state):
    return nnx.to_pure_dict(state)["tree"]


def test_call_equals_forward_bitwise():
    model = ComposerTransformer(CFG, rngs=nnx.Rngs(0))
    params = cj.init_params(CFG, nnx.Rngs(0).params())
    tokens = _tokens(CFG)
    jax.tree.map(np.testing.assert_array_equal, model.params(), params)
    got, want = model(tokens), cj.forward(params, tokens, CFG)
    np.testing.assert_array_equal(np.asarray(got.logits), np.asarray(want.logits))
    np.testing.assert_array_equal(np.asarray(got.mtp_logits), np.asarray(want.mtp_logits))
    np.testing.assert_array_equal(np.asarray(got.routing), np.asarray(want.routing))
    # forward's keyword arguments pass through (packed segments here)
    seg = jnp.asarray([[1, 1, 1, 2, 2, 2, 2, 0]] * 2, jnp.int32)
    np.testing.assert_array_equal(
        np.asarray(model(tokens, segment_ids=seg).logits),
        np.asarray(cj.forward(params, tokens, CFG, segment_ids=seg).logits),
    )


def test_split_merge_round_trip_and_jit():
    model = ComposerTransformer(CFG, rngs=nnx.Rngs(1))
    tokens = _tokens(CFG)
    graphdef, state = nnx.split(model)
    jax.tree.map(np.testing.assert_array_equal, _plain(state), model.params())
    back = nnx.merge(graphdef, state)
    np.testing.assert_array_equal(np.asarray(back(tokens).logits), np.asarray(model(tokens).logits))
    # the functional form NNX code jits: (graphdef static, state as the pytree argument)
    run = jax.jit(lambda st, t: nnx.merge(graphdef, st)(t).logits)
    np.testing.assert_allclose(np.asarray(run(state, tokens)), np.asarray(model(tokens).logits), rtol=0, atol=1e-6)
    # a changed state merges into a changed model; the original is untouched
    bumped = jax.tree.map(lambda x: x + 1.0 if jnp.issubdtype(x.dtype, jnp.floating) else x, state)
    assert not np.array_equal(np.asarray(nnx.merge(graphdef, bumped)(tokens).logits), np.asarray(model(tokens).logits))
    # router biases are their own variable type, exactly where the optimiser must not go
    free = jax.tree.leaves(gradient_free_mask(CFG))
    kinds = jax.tree.leaves(
        jax.tree.map(lambda v: isinstance(v, RouterBias), state, is_leaf=lambda x: isinstance(x, nnx.Variable))
    )
    assert kinds == free and any(free)
    assert len(jax.tree.leaves(nnx.state(model, RouterBias))) == sum(free)


def test_from_params_checks_the_tree():
    params = cj.init_params(CFG, jax.random.key(0))
    model = ComposerTransformer.from_params(CFG, params)
    jax.tree.map(np.testing.assert_array_equal, model.params(), params)
    with pytest.raises(ValueError, match="exactly one of rngs= .* or params="):
        ComposerTransformer(CFG)
    smaller = dict(params)
    del smaller["lm_head"]
    with pytest.raises(ValueError, match="structure of param_specs"):
        ComposerTransformer.from_params(CFG, smaller)
    wrong = dict(params, final_norm=jnp.ones((3,)))
    with pytest.raises(ValueError, match=r"shape \(3,\), param_specs\(cfg\) says \(64,\)"):
        ComposerTransformer.from_params(CFG, wrong)
    with pytest.raises(ValueError, match="own sharding"):
        model(_tokens(CFG), sharding=None)


# the kv_lora rule in the full suite only: [None] keeps the property (the specs are the project's)
@pytest.mark.parametrize("rules", [None, pytest.param({"kv_lora": ["tensor"]}, marks=pytest.mark.slow)])
def test_partition_specs_equal_the_projects_shardings(rules):
    # vocabulary 511: odd, so the tensor axis is dropped from it, as ShardingRules drops it
    cfg = dataclasses.replace(CFG, vocab_size=511)
    mesh = cj.make_mesh(cj.MeshConfig(data=1, fsdp=2, expert=2, context=1, tensor=2))
    sr = ShardingRules.create(rules)
    model = ComposerTransformer(cfg, rngs=nnx.Rngs(0), sharding=MeshRules(mesh, sr))
    state = nnx.state(model)
    want = param_shardings(cfg, mesh, sr)
    specs = nnx.to_pure_dict(nnx.get_partition_spec(state))["tree"]
    named = nnx.to_pure_dict(nnx.get_named_sharding(state, mesh))["tree"]
    flat_want = jax.tree_util.tree_leaves_with_path(want)
    assert len(flat_want) == len(jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec)))
    sharded = 0
    for path, sh in flat_want:
        spec, ns, value = (_at(t, path) for t in (specs, named, model.params()))
        assert spec == sh.spec, (path, spec, sh.spec)
        assert ns == sh
        assert value.sharding.is_equivalent_to(sh, value.ndim)  # values placed as the project places them
        sharded += any(e is not None for e in spec)
    assert sharded > 10
    assert _at(specs, ("embed",))[0] is None  # 511 rows: tensor dropped
    # the logical axes travel with every leaf
    assert model.tree["embed"].get_metadata("out_sharding") == ("vocab", "embed")
    # and the sharded module computes the unsharded forward
    tokens = _tokens(cfg, (4, 8))
    plain = ComposerTransformer.from_params(cfg, jax.tree.map(jnp.asarray, jax.device_get(model.params())))
    np.testing.assert_allclose(
        np.asarray(jax.jit(lambda t: model(t).logits)(tokens)), np.asarray(plain(tokens).logits), atol=2e-5, rtol=0
    )


def _at(tree, path):
    for k in path:
        tree = tree[getattr(k, "key", k)]
    return tree


# slow (13 s of the default suite's compiling): test_call_equals_forward_bitwise keeps the module's
# call equal to the forward bit for bit (so jax's gradient through it is the forward's), and
# test_split_merge_round_trip_and_jit its nnx.Param state, by default
@pytest.mark.slow
def test_nnx_grad_equals_jax_grad_of_forward():
    model = ComposerTransformer(CFG, rngs=nnx.Rngs(2))
    params = model.params()
    tokens = _tokens(CFG)
    # wrt nnx.Param: no router biases; both jitted (op-by-op dispatch of the layer scan costs ~3x)
    got = _plain(nnx.jit(nnx.grad(lambda m: _loss(m(tokens), tokens)))(model))
    want = jax.jit(jax.grad(lambda p: _loss(cj.forward(p, tokens, CFG), tokens)))(params)
    free = gradient_free_mask(CFG)
    n = 0
    for (path, w), (_, is_free) in zip(
        jax.tree_util.tree_leaves_with_path(want), jax.tree_util.tree_leaves_with_path(free)
    ):
        if is_free:
            with pytest.raises(KeyError):
                _at(got, path)
            continue
        g = _at(got, path)
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=1e-6, err_msg=str(path))
        n += 1
    assert n == len(jax.tree.leaves(got)) and np.abs(np.asarray(_at(got, ("embed",)))).sum() > 0


def test_package_imports_flax_only_through_this_module():
    code = (
        "import sys; import composer_jax as cj, composer_jax.model.transformer, composer_jax.train.step;"
        " import composer_jax.env.server.app; assert 'flax' not in sys.modules, 'flax imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
