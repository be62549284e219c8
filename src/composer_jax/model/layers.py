"""Building blocks: RMSNorm, rotary embeddings with YaRN, SwiGLU MLP."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from composer_jax.config import ModelConfig, RopeScalingConfig


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """x: [..., d] -> [..., d]; statistics in float32, result in x's dtype times the weight."""
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * y.astype(x.dtype)


def linear(x: jax.Array, w: jax.Array, contract: int = 1, preferred_element_type=None) -> jax.Array:
    """x [..., *in] @ w [*in, *out] -> [..., *out], contracting the last `contract` axes of x with
    the first `contract` axes of w, computed as one 2-D matmul [tokens, in] @ [in, out].

    Why 2-D: XLA:CPU runs the backward of a matmul whose activations keep a [batch, seq, ...]
    shape as a dot contracting two axes, for which it transposes the activation gradient and falls
    off its fast matmul path: a SwiGLU's forward+backward at [8, 512, 256] -> 1024 took 296 ms with
    3-D activations and 127 ms flattened (bench/train_step.py shape). Same numbers either way."""
    lead = x.shape[: x.ndim - contract]
    d_in = math.prod(x.shape[x.ndim - contract :])
    out = w.shape[contract:]
    y = jnp.matmul(
        x.reshape(-1, d_in), w.reshape(d_in, -1).astype(x.dtype), preferred_element_type=preferred_element_type
    )
    return y.reshape(*lead, *out)


def swiglu(x: jax.Array, gate: jax.Array, up: jax.Array, down: jax.Array) -> jax.Array:
    """x: [..., d]; gate/up: [d, f]; down: [f, d] -> [..., d]."""
    h = jax.nn.silu(linear(x, gate)) * linear(x, up)
    return linear(h, down)


# --------------------------------------------------------------------------------------------------
# Rotary position embeddings
# --------------------------------------------------------------------------------------------------


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN magnitude correction 0.1 * mscale * ln(scale) + 1 (1 when not extending)."""
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(dim: int, theta: float, scaling: RopeScalingConfig) -> tuple[np.ndarray, float]:
    """Inverse frequencies [dim/2] (float32) and the cos/sin magnitude factor.

    YaRN (Peng et al. 2023, arXiv 2309.00071): dimensions rotating faster than beta_fast turns over
    the original context keep their frequency (extrapolation), slower than beta_slow are divided by
    the factor (interpolation), with a linear ramp between.
    """
    pos_freqs = np.float32(theta) ** (np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim))
    inv_extra = (1.0 / pos_freqs).astype(np.float32)
    if scaling.type != "yarn":
        return inv_extra, 1.0
    f = scaling.factor
    inv_inter = (1.0 / (np.float32(f) * pos_freqs)).astype(np.float32)

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(scaling.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(theta)
        )

    low, high = correction_dim(scaling.beta_fast), correction_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1).astype(np.float32)
    extra_factor = (1 - ramp).astype(np.float32)
    inv = (inv_inter * (1 - extra_factor) + inv_extra * extra_factor).astype(np.float32)
    if scaling.mscale and scaling.mscale_all_dim:
        attn_factor = yarn_mscale(f, scaling.mscale) / yarn_mscale(f, scaling.mscale_all_dim)
    else:
        attn_factor = yarn_mscale(f)
    return inv, float(attn_factor)


def softmax_scale(cfg: ModelConfig) -> float:
    """1/sqrt(qk_head_dim), times DeepSeek's mscale_all_dim^2 correction under YaRN."""
    scale = cfg.qk_head_dim**-0.5
    rs = cfg.rope_scaling
    if rs.type == "yarn" and rs.mscale_all_dim:
        m = yarn_mscale(rs.factor, rs.mscale_all_dim)
        scale = scale * m * m
    return scale


def rope_cos_sin(positions: jax.Array, dim: int, cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """positions: int32[batch, seq] -> cos, sin: float32[batch, seq, dim/2]."""
    inv_freq, factor = rope_frequencies(dim, cfg.rope_theta, cfg.rope_scaling)
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq)
    return jnp.cos(angles) * factor, jnp.sin(angles) * factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, interleave: bool) -> jax.Array:
    """x: [batch, seq, heads, dim]; cos/sin: [batch, seq, dim/2].

    interleave=True rotates adjacent pairs (x0,x1),(x2,x3)... (DeepSeek weights) and returns the
    rotated halves concatenated [even | odd]; the same permutation is applied to q and k, so q.k is
    exactly that of the in-place pairwise rotation. interleave=False rotates (x_i, x_{i+dim/2}).
    """
    c = cos[:, :, None, :].astype(jnp.float32)
    s = sin[:, :, None, :].astype(jnp.float32)
    xf = x.astype(jnp.float32)
    if interleave:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    else:
        half = x.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
    out = jnp.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)
    return out.astype(x.dtype)
