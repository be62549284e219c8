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
    m = dataclasses.replace(cj.load_config(CONFIGS / "tiny.yaml").model, moe_impl=moe_impl,
                            attention_impl="blockwise", attn_block_q=8, attn_block_k=16)
    params = cj.init_params(m, jax.random.key(0))
    tokens = jnp.zeros((2, 32), jnp.int32)

    def loss(p, t):
        return jnp.mean(jax.nn.log_softmax(cj.forward(p, t, m).logits)[..., 0])

    lowered = jax.jit(jax.value_and_grad(loss)).trace(params, tokens).lower(lowering_platforms=("cuda",))
    text = lowered.as_text()
    assert "stablehlo" in text or "func.func" in text
    if moe_impl == "ragged":
        assert "ragged_dot" in text
