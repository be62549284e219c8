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
