"""`Recipe(backend="pallas")`: the quantisation and the three products of forward and backward run as
`pallas_kernels` (interpret mode on CPU) and equal the XLA reference backend - quantised operands bit
for bit, products and gradients within float32 accumulation tolerance - on ragged group sizes with
empty groups, through the tile and ragged grouped matmuls and through the MoE layer; the backend is
chosen in the config and a bad value is named."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import composer_jax as cj
from composer_jax.config import ConfigError
from composer_jax.model.moe import grouped, layer
from composer_jax.quant import formats as F
from composer_jax.quant import grouped_matmul as G
from composer_jax.quant import pallas_backend as P
from composer_jax.quant import recipe as R
from composer_jax.sharding import MeshRules
from pallas_kernels import grouped_matmul_bwd as B

TINY = Path(__file__).resolve().parents[2] / "configs" / "model" / "tiny.yaml"
ROWS, K, N = 80, 48, 40  # neither K nor N a multiple of 32: the backend pads
SIZES = [0, 23, 0, 9, 33, 0]  # 65 rows in groups, 15 past them
RECIPES = ["mxfp8", "nvfp4_fwd_mxfp8_bwd"]


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(ROWS, K)) * np.exp2(rng.integers(-4, 4, (ROWS, 1)))
    w = rng.normal(size=(len(SIZES), K, N)) * np.exp2(rng.integers(-3, 3, (len(SIZES), 1, N)))
    dy = rng.normal(size=(ROWS, N))
    return (jnp.asarray(a.astype(np.float32)) for a in (x, w, dy))


def _mx_values(v, s, axis):
    """float32 values of E4M3 elements with E8M0 scales blocked along `axis` (numpy decode)."""
    scale = np.exp2(np.asarray(s).astype(np.float64) - 127)
    return np.asarray(v).astype(np.float32) * np.repeat(scale, 32, axis=axis).astype(np.float32)


def _nvfp4_values(packed, sb, s2):
    e = np.asarray(F.codes_to_e2m1(F.unpack_fp4(packed)))
    return (e * np.repeat(np.asarray(sb).astype(np.float32), 16, axis=-1)) * np.asarray(s2)


def test_quantised_operands_equal_the_reference_bit_for_bit():
    x, w, dy = _data()
    sizes = jnp.asarray(SIZES, jnp.int32)
    g = len(SIZES)
    # forward, MXFP8 along K: activations row-wise, weights blocked along their K axis
    v, s = P.mx_along_cols(x, "ceil")
    np.testing.assert_array_equal(_mx_values(v, s, 1)[:ROWS, :K], F.fake_quantize(x, "mxfp8_e4m3", 1, rule="ceil"))
    v, s = P.mx_along_rows(jnp.pad(w, ((0, 0), (0, 16), (0, 0))).reshape(g * 64, N), "ocp")
    got = _mx_values(v, s, 0).reshape(g, 64, -1)[:, :K, :N]
    np.testing.assert_array_equal(got, F.fake_quantize(w, "mxfp8_e4m3", 1, rule="ocp"))
    # forward, NVFP4 per token (and per tensor), weights one second scale per expert
    for second in ("token", "tensor"):
        s2 = None if second == "token" else jnp.broadcast_to(jnp.max(jnp.abs(x)) / (448 * 6), (ROWS, 1))
        got = _nvfp4_values(*P.nvfp4_rows(x, s2))[:ROWS, :K]
        np.testing.assert_array_equal(got, F.fake_quantize(x, "nvfp4", 1, second=second))
    wp, wsb, ws2 = P.nvfp4_weight_along_k(w)
    got = _nvfp4_values(jnp.swapaxes(wp, 1, 2), jnp.swapaxes(wsb, 1, 2), ws2[:, None, None])
    np.testing.assert_array_equal(np.swapaxes(got, 1, 2)[:, :K, :N], F.fake_quantize(w, "nvfp4", 1, second=(1, 2)))
    # dgrad operands along N; wgrad operands along the rows, blocks restarting at each group
    v, s = P.mx_along_cols(dy, "ceil")
    np.testing.assert_array_equal(_mx_values(v, s, 1)[:ROWS, :N], F.fake_quantize(dy, "mxfp8_e4m3", 1, rule="ceil"))
    dest, _ = B.group_padded_rows(sizes, ROWS)
    v, s = P.mx_along_rows(B.to_group_padded(x, sizes), "ceil")
    got = _mx_values(v, s, 0)[np.asarray(dest)[: sum(SIZES)], :K]
    ref = G.mx_fake_quantize_grouped_rows(x, sizes, "ceil")[: sum(SIZES)]
    np.testing.assert_array_equal(got, ref)


def _close(a, b, what):
    scale = max(float(jnp.abs(b).max()), 1e-30)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5 * scale, err_msg=what)


@pytest.mark.parametrize("name", RECIPES)
def test_ragged_matmul_forward_and_gradients_equal_the_xla_backend(name):
    x, w, dy = _data(1)
    sizes = jnp.asarray(SIZES, jnp.int32)
    out = {}
    for backend in ("xla", "pallas"):
        r = R.recipe(name, backend=backend)
        y, vjp = jax.vjp(lambda x_, w_, r=r: G.ragged_matmul(x_, w_, sizes, r), x, w)
        out[backend] = (y, *vjp(dy))
    for what, a, b in zip(("y", "dx", "dw"), out["pallas"], out["xla"]):
        _close(a, b, what)
    y, dx, dw = out["pallas"]
    assert np.all(np.asarray(y)[sum(SIZES) :] == 0) and np.all(np.asarray(dx)[sum(SIZES) :] == 0)
    assert np.all(np.asarray(dw)[[0, 2, 5]] == 0)  # empty groups: no gradient


@pytest.mark.slow  # ~25 s of interpret-mode compiles; the tiled MoE layer test below covers this path too
def test_tile_matmul_forward_and_gradients_equal_the_xla_backend():
    x, w, dy = _data(2)
    xt, wt, dyt = x[:64].reshape(4, 16, K), w[:4], dy[:64].reshape(4, 16, N)  # tiles of 16 rows
    out = {}
    for backend in ("xla", "pallas"):
        r = R.recipe("nvfp4_fwd_mxfp8_bwd", backend=backend)
        y, vjp = jax.vjp(lambda x_, w_, r=r: G.tile_matmul(x_, w_, r), xt, wt)
        out[backend] = (y, *vjp(dyt))
    for what, a, b in zip(("y", "dx", "dw"), out["pallas"], out["xla"]):
        _close(a, b, what)


def _cfg(**kw):
    base = dict(hidden_size=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, num_shared_experts=1)
    return dataclasses.replace(cj.ModelConfig(), **{**base, "n_group": 4, "topk_group": 2, **kw})


@pytest.mark.parametrize("impl", ["ragged", "tiled"])
def test_moe_layer_on_the_pallas_backend_equals_the_xla_backend(impl):
    keys = jax.random.split(jax.random.key(0), 8)
    d, e, f = 32, 8, 32
    shapes = {"router": (d, e), "router_bias": (e,), "gate": (e, d, f), "up": (e, d, f), "down": (e, f, d)}
    shapes.update(shared_gate=(d, f), shared_up=(d, f), shared_down=(f, d))
    p = {name: 0.3 * jax.random.normal(k, s) for k, (name, s) in zip(keys, shapes.items())}
    x = jax.random.normal(jax.random.key(1), (2, 8, d))  # 32 assignments over 8 experts: some empty
    c = jax.random.normal(jax.random.key(2), x.shape)
    out = {}
    for backend in ("xla", "pallas"):
        cfg = _cfg(moe_impl=impl, moe_tile_size=16, moe_precision="nvfp4_fwd_mxfp8_bwd", moe_quant_backend=backend)

        def loss(p, x, cfg=cfg):
            y = layer.moe_layer(p, x, cfg, None)[0]
            return jnp.sum(y * c), y

        (_, y), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(p, x)
        out[backend] = (y, grads)
    _close(out["pallas"][0], out["xla"][0], "y")
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(out["pallas"][1]), jax.tree.leaves(out["xla"][1])):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * max(float(jnp.abs(b).max()), 1e-30), err_msg=str(path))


def test_backend_is_chosen_in_the_config_and_bad_values_are_named():
    assert cj.ModelConfig().moe_quant_backend == "xla"
    cfg = cj.load_config(TINY, ["model.moe_precision=mxfp8", "model.moe_quant_backend=pallas"], num_devices=None)
    assert grouped.moe_recipe(cfg.model) == R.recipe("mxfp8", backend="pallas")
    with pytest.raises(ConfigError, match="cuda"):
        cj.load_config(TINY, ["model.moe_quant_backend=cuda"], num_devices=None)
    with pytest.raises(ValueError, match="'tpu'.*xla, pallas"):
        R.recipe("mxfp8", backend="tpu")
    with pytest.raises(ValueError, match="pallas.*'bf16'"):
        R.recipe("bf16", backend="pallas")


def test_moe_layer_forward_and_backward_on_the_pallas_backend_lower_for_cuda(monkeypatch):
    """Lowered for CUDA (compiled kernels, as on a GPU machine), the layer's gradient holds every
    kernel of the recipe as a Triton custom call: NVFP4 quantisation and matmul forward, MXFP8
    row/column quantisation, dgrad and wgrad backward."""
    monkeypatch.setattr(P, "interpret_mode", lambda: False)
    cfg = _cfg(moe_impl="ragged", moe_precision="nvfp4_fwd_mxfp8_bwd", moe_quant_backend="pallas")
    d, e, f = 32, 8, 32
    shapes = {"router": (d, e), "router_bias": (e,), "gate": (e, d, f), "up": (e, d, f), "down": (e, f, d)}
    shapes.update(shared_gate=(d, f), shared_up=(d, f), shared_down=(f, d))
    p = {name: jax.ShapeDtypeStruct(s, jnp.float32) for name, s in shapes.items()}
    x = jax.ShapeDtypeStruct((2, 32, d), jnp.float32)
    grad = jax.jit(jax.grad(lambda p, x: jnp.sum(layer.moe_layer(p, x, cfg, None)[0]), argnums=(0, 1)))
    text = grad.trace(p, x).lower(lowering_platforms=("cuda",)).as_text()
    assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") >= 6
    kernels = set(re.findall(r'name = "(_[a-z0-9_]*kernel)"', text))
    # _kernel: the NVFP4 quantisation; _nvfp4_kernel its matmul; _row/_col: MXFP8 quantisation
    assert kernels == {"_kernel", "_nvfp4_kernel", "_row_kernel", "_col_kernel", "_dgrad_kernel", "_wgrad_kernel"}


def test_expert_parallel_layer_lowers_for_cuda_and_the_interpreter_refuses_a_mesh(monkeypatch):
    """Inside the MoE layer's shard_map (expert parallelism over a fake 8-device mesh) the kernels
    lower for CUDA; the Pallas interpreter cannot run there (check_vma), and says so."""
    cfg = _cfg(moe_impl="ragged", moe_precision="nvfp4_fwd_mxfp8_bwd", moe_quant_backend="pallas")
    keys = jax.random.split(jax.random.key(0), 8)
    shapes = {"router": (32, 8), "router_bias": (8,), "gate": (8, 32, 32), "up": (8, 32, 32), "down": (8, 32, 32)}
    shapes.update(shared_gate=(32, 32), shared_up=(32, 32), shared_down=(32, 32))
    p = {name: 0.3 * jax.random.normal(k, s) for k, (name, s) in zip(keys, shapes.items())}
    x = jax.random.normal(jax.random.key(1), (8, 4, 32))
    sharding = MeshRules(cj.make_mesh(cj.MeshConfig(data=2, fsdp=2, expert=2, context=1, tensor=1)))
    grad = jax.jit(jax.grad(lambda p, x: jnp.sum(layer.moe_layer(p, x, cfg, sharding)[0]), argnums=(0, 1)))
    with pytest.raises(NotImplementedError, match="moe_quant_backend='xla' with a mesh"):
        grad(p, x)
    monkeypatch.setattr(P, "interpret_mode", lambda: False)
    text = grad.trace(p, x).lower(lowering_platforms=("cuda",)).as_text()
    kernels = set(re.findall(r'name = "(_[a-z0-9_]*kernel)"', text))
    assert kernels == {"_kernel", "_nvfp4_kernel", "_row_kernel", "_col_kernel", "_dgrad_kernel", "_wgrad_kernel"}
