"""`model.moe_precision` through every MoE dispatch path (tiled dispatch, sorted tiled, ragged_dot,
expert parallelism), and the tiny model trained with NVFP4 forward / MXFP8 backward against the
unquantised run."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import composer_jax as cj
from composer_jax.config import ConfigError
from composer_jax.model.moe import layer
from composer_jax.sharding import MeshRules

TINY = Path(__file__).resolve().parents[2] / "configs" / "model" / "tiny.yaml"


def _cfg(**kw):
    base = dict(hidden_size=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, num_shared_experts=1)
    base.update(n_group=4, topk_group=2, topk_method="noaux_tc")
    return dataclasses.replace(cj.ModelConfig(), **{**base, **kw})


def _params(cfg, key):
    ks = jax.random.split(key, 8)
    d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    n = lambda k, s: 0.3 * jax.random.normal(k, s)
    shapes = {
        "router": (d, e),
        "router_bias": (e,),
        "gate": (e, d, f),
        "up": (e, d, f),
        "down": (e, f, d),
        "shared_gate": (d, f),
        "shared_up": (d, f),
        "shared_down": (f, d),
    }
    return {name: n(k, s) for k, (name, s) in zip(ks, shapes.items())}


def _rel(a, b):
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def _layer_and_grads(p, x, cfg, sharding=None):
    c = jax.random.normal(jax.random.key(9), x.shape)  # a fixed cotangent for y

    def loss(p, x):
        y, _, _ = layer.moe_layer(p, x, cfg, sharding)
        return jnp.sum(y * c), y

    (_, y), g = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(p, x)
    return y, g


# Relative error against the unquantised layer with a fixed linear cotangent (measured: MXFP8
# y 0.042, dx 0.041, expert and router weights 0.063-0.079; NVFP4 forward y 0.138, dx 0.108,
# weights 0.16-0.20 - the wgrad of `down` and the router see the forward's NVFP4 error).
LAYER_BOUND = {"mxfp8": (0.06, 0.1), "nvfp4_fwd_mxfp8_bwd": (0.18, 0.25)}


@pytest.mark.parametrize("precision", [pytest.param("mxfp8", marks=pytest.mark.slow), "nvfp4_fwd_mxfp8_bwd"])
def test_tiled_and_ragged_paths_quantise_alike(precision):
    p = _params(_cfg(), jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (2, 24, 32))
    ref_y, ref_g = _layer_and_grads(p, x, _cfg(moe_impl="tiled"))
    y_bound, g_bound = LAYER_BOUND[precision]
    out = {}
    for impl, tile in (("tiled", 8), ("ragged", 128)):
        y, g = _layer_and_grads(p, x, _cfg(moe_impl=impl, moe_tile_size=tile, moe_precision=precision))
        assert 0 < _rel(y, ref_y) < y_bound, (impl, tile)
        for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g), jax.tree.leaves(ref_g)):
            if float(jnp.abs(b).max()) == 0:  # the router bias: selection only, no gradient
                assert float(jnp.abs(a).max()) == 0
            else:
                assert _rel(a, b) < g_bound, (impl, tile, jax.tree_util.keystr(path))
        out[impl, tile] = y
    # the forward quantises tokens alone and weights per expert: the same values on every path
    np.testing.assert_allclose(out["tiled", 8], out["ragged", 128], atol=2e-5)


@pytest.mark.slow  # ~50 s each on 2 loaded cores (an 8-device shard_map, forward and backward)
@pytest.mark.parametrize("impl", ["auto", "ragged"])  # auto: tiled on CPU; ragged: what GPUs run
def test_expert_parallel_quantised_layer_matches_one_device(impl):
    # the ragged path's weights vary only over the expert axis and its tokens over all: the custom
    # VJP must see one type (and sum the weight gradient over the data axes)
    cfg = _cfg(moe_precision="nvfp4_fwd_mxfp8_bwd", moe_impl=impl)
    p = _params(cfg, jax.random.key(2))
    x = jax.random.normal(jax.random.key(3), (8, 12, 32))
    y1, g1 = _layer_and_grads(p, x, cfg)
    mesh = cj.make_mesh(cj.MeshConfig(data=2, fsdp=2, expert=2, context=1, tensor=1))
    y8, g8 = _layer_and_grads(p, x, cfg, MeshRules(mesh))
    np.testing.assert_allclose(y8, y1, atol=2e-5)
    # the backward's MX blocks along rows follow each layout's tiles: close, not equal
    for a, b in zip(jax.tree.leaves(g8), jax.tree.leaves(g1)):
        assert float(jnp.linalg.norm(a - b)) <= 0.05 * float(jnp.linalg.norm(b))


def test_dense_reference_refuses_quantisation_and_the_default_is_bf16():
    assert cj.ModelConfig().moe_precision == "bf16"
    with pytest.raises(ConfigError, match="moe_precision"):
        cj.load_config(TINY, ["model.moe_impl=dense", "model.moe_precision=mxfp8"])
    with pytest.raises(ConfigError):
        cj.load_config(TINY, ["model.moe_precision=fp8"])


def _train(precision: str, steps: int = 30) -> list[float]:
    cfg = cj.load_config(TINY, ["model.num_mtp_layers=0", f"model.moe_precision={precision}"], num_devices=None)
    m = cfg.model
    params = cj.init_params(m, jax.random.key(0))
    rng = np.random.default_rng(0)
    # learnable data: each row repeats a random 8-token phrase
    tokens = jnp.asarray(np.tile(rng.integers(0, m.vocab_size, (8, 8)), (1, 4)).astype(np.int32))

    def loss(p):
        lp = jax.nn.log_softmax(cj.forward(p, tokens, m).logits[:, :-1])
        return -jnp.take_along_axis(lp, tokens[:, 1:, None], -1).mean()

    opt = optax.adam(3e-3)

    @jax.jit
    def step(p, s):
        value, g = jax.value_and_grad(loss)(p)
        u, s = opt.update(g, s, p)
        return optax.apply_updates(p, u), s, value

    state = opt.init(params)
    losses = []
    for _ in range(steps):
        params, state, value = step(params, state)
        losses.append(float(value))
    return losses


@pytest.mark.slow  # two 30-step runs of the tiny model, ~100 s on 2 loaded cores
def test_tiny_model_trains_with_nvfp4_forward_mxfp8_backward_within_5_percent_of_bf16():
    ref = _train("bf16")
    got = _train("nvfp4_fwd_mxfp8_bwd")
    assert ref[-1] < 0.8 * ref[0]  # it learns
    assert abs(got[-1] - ref[-1]) / ref[-1] < 0.05, (got[-1], ref[-1])
