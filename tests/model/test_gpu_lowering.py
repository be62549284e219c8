"""The model's training computation lowers for CUDA from this CPU-only machine (GPU code is
checked by lowering here; it runs on a GPU elsewhere): blockwise attention with its custom VJP,
and the ragged_dot MoE path that "auto" picks on GPU."""

import dataclasses
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

import composer_jax as cj

CONFIGS = Path(__file__).resolve().parents[2] / "configs/model"


@pytest.mark.parametrize("moe_impl", ["ragged", "tiled"])
def test_forward_and_gradient_lower_for_cuda(moe_impl):
    m = dataclasses.replace(
        cj.load_config(CONFIGS / "tiny.yaml").model,
        moe_impl=moe_impl,
        attention_impl="blockwise",
        attn_block_q=8,
        attn_block_k=16,
    )
    params = cj.init_params(m, jax.random.key(0))
    batch, seq = 2, 32
    tokens = jnp.zeros((batch, seq), jnp.int32)

    def loss(p, t):
        return jnp.mean(jax.nn.log_softmax(cj.forward(p, t, m).logits)[..., 0])

    lowered = jax.jit(jax.value_and_grad(loss)).trace(params, tokens).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()

    # Blockwise attention: scores exist only as [batch, heads, block_q, block_k] tiles, never as the
    # full [batch, heads, seq, seq] matrix (which dense attention builds, forward and backward).
    h = m.num_heads
    tile, full = f"tensor<{batch}x{h}x{m.attn_block_q}x{m.attn_block_k}xf32>", f"tensor<{batch}x{h}x{seq}x{seq}x"
    assert tile in text, f"no {tile} score tiles in the lowered text"
    assert full not in text, f"a full {full}...> score matrix in the lowered text"

    # The ragged path keeps chlo.ragged_dot for CUDA (a CPU lowering decomposes it into dots). Each
    # lowered MoE body (the layers share one: scanned, or one deduplicated function) holds its three
    # expert matmuls (gate, up, down) once forward and twice backward (the cotangents of the tokens
    # and of the expert weights, both ragged too): 9 per body.
    n_ragged = text.count('"chlo.ragged_dot"(')
    if moe_impl == "ragged":
        assert n_ragged > 0 and n_ragged % 9 == 0, n_ragged
    else:
        assert n_ragged == 0


def test_ragged_expert_parallel_layer_lowers_for_cuda_with_the_ragged_op():
    """The ragged exchange lowers for CUDA (XLA:CPU cannot compile it): the HLO of the layer's
    forward and gradient holds four `ragged-all-to-all` ops (dispatch, combine and their
    transposes in the backward pass) over the bounded receive buffer (capacity 2.0 x 24
    assignments = 48 rows per device, where the padded path receives EP x 24 = 96), no all-to-all
    of float rows, and the expert matmuls as ragged dots over those 48 rows."""
    from support.moe_cases import moe_cfg as _cfg
    from support.moe_cases import moe_params as _moe_params

    from composer_jax.model.moe import layer
    from composer_jax.sharding import MeshRules, ShardingRules

    cfg = _cfg(moe_impl="ragged", moe_ep_exchange="ragged", moe_ep_capacity_factor=2.0)
    p = _moe_params(cfg, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (8, 12, cfg.hidden_size))  # 12 tokens x k 2 per device
    mesh = cj.make_mesh(cj.MeshConfig(data=1, fsdp=2, expert=4, context=1, tensor=1))
    sharding = MeshRules(mesh, ShardingRules.create())

    def loss(p, x):
        return jnp.sum(jnp.sin(layer.moe_layer(p, x, cfg, sharding)[0]))

    lowered = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).trace(p, x).lower(lowering_platforms=("cuda",))
    hlo = lowered.compiler_ir("hlo").as_hlo_text()
    ops = [line for line in hlo.splitlines() if "ragged-all-to-all(" in line]
    assert len(ops) == 4, ops
    d = cfg.hidden_size
    assert sum(f"f32[48,{d}]" in op for op in ops) == 2  # into the receive buffer, forward and backward
    assert sum(f"f32[24,{d}]" in op for op in ops) == 2  # back into the sorted assignments
    assert not [line for line in hlo.splitlines() if " all-to-all(" in line and "f32[" in line.split("=")[1][:12]]
    dots = [line for line in hlo.splitlines() if "ragged-dot(" in line]
    assert dots and all("[48," in line.split("=")[1][:16] for line in dots[:3]), dots[:3]
