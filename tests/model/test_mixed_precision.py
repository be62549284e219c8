"""float32 master weights with bfloat16 compute (`model.param_dtype=float32`,
`model.compute_dtype=bfloat16`): the forward computes with bfloat16 copies of the weights (the
router's stay float32), the gradient comes back float32, and the result is the float32 model's to
bfloat16 accuracy. Before `transformer.compute_params` the layer scan refused to trace (its carry
came back float32)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp

import composer_jax as cj
from composer_jax.model.transformer import compute_params

F32 = dataclasses.replace(
    cj.load_config(str(Path(__file__).resolve().parents[2] / "configs/model/tiny.yaml")).model,
    max_position_embeddings=64,
)
MIXED = dataclasses.replace(F32, param_dtype="float32", compute_dtype="bfloat16")


def test_compute_params_casts_every_weight_but_the_router():
    params = cj.init_params(MIXED, jax.random.key(0))
    cast = compute_params(params, MIXED)
    for path, x in jax.tree_util.tree_leaves_with_path(cast):
        name = str(path[-1].key)
        assert x.dtype == (jnp.float32 if name.startswith("router") else jnp.bfloat16), (
            jax.tree_util.keystr(path),
            x.dtype,
        )
    assert compute_params(params, F32) is params  # one dtype: nothing to do


def test_forward_and_gradient_with_float32_weights_and_bfloat16_compute():
    params = cj.init_params(MIXED, jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (2, 16), 0, MIXED.vocab_size, jnp.int32)
    mixed, full = (jax.jit(lambda p, c=c: cj.forward(p, tokens, c).logits)(params) for c in (MIXED, F32))
    # bfloat16 keeps 8 bits of mantissa: logits to ~1e-2 of their scale, not float32's 1e-6
    err, scale = float(jnp.abs(mixed - full).max()), float(jnp.abs(full).max())
    assert 0 < err < 2e-2 * scale, (err, scale)  # > 0: it did compute in bfloat16
    # the gradient traces (the layer scan's carry stays bfloat16) and comes back float32
    grads = jax.eval_shape(jax.grad(lambda p: cj.forward(p, tokens, MIXED).logits.astype(jnp.float32).mean()), params)
    assert {g.dtype for g in jax.tree.leaves(grads)} == {jnp.dtype(jnp.float32)}
