"""Exact padding of MLA's latent and rotary dimensions to the sizes vLLM's MLA kernels take.

vLLM runs MLA only for kv_lora_rank + qk_rope_head_dim in a short list (its CPU kernel: 576 =
512 + 64); small models (the tiny config: 32 + 8) are refused with "Head dimension 40 is not
supported by MLA". `pad_mla(cfg, params)` returns a config and parameters of the padded sizes that
compute the same function; every step is exact in binary floating point, or refused:

- Latent (kv_lora_rank r -> R): the kv_a projection's latent columns are repeated R / r times, so
  the RMSNorm's mean of squares over R equals the one over r, with the same eps (zero-padding
  would need the norm weight scaled by sqrt(R / r) and eps divided by R / r, and eps is shared by
  every norm); the norm weight keeps the first copy (the rest are 0) and kv_b reads that copy
  only. R must be a multiple of r.
- Rotary (qk_rope_head_dim d -> D, D / d = s an integer): pair i at dim d turns at
  theta^(-2i/d) = theta^(-2(s i)/D), the frequency of pair s i at dim D, so the query and key
  rotary columns go to pairs s i and the other pairs are zero (rotating zeros gives zeros). The
  output is in the interleaved layout vLLM's DeepSeek always uses (a half-split model is permuted
  the same way on queries and keys, which leaves q.k unchanged). Under YaRN the ramp bounds are
  recomputed at D; `hf_rope.export_rope` finds fields whose frequencies at pairs s i are the model's
  bit for bit, or the padding is refused.
- Softmax scale: 1 / sqrt(qk_nope_head_dim + qk_rope_head_dim) changes with D. The no-rope part
  is zero-padded too (zero columns in q and in kv_b's key rows add nothing to q.k) so that the new
  qk head dimension is 4^m times the old one, and the query weights are multiplied by 2^m: a power
  of two, exact in float32 and bfloat16 alike.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from composer_jax.config import ConfigError, ModelConfig, validate_model
from composer_jax.hf.rope import export_rope

VLLM_MLA_LATENT, VLLM_MLA_ROPE = 512, 64  # kv_lora_rank + qk_rope_head_dim = 576: vLLM's CPU MLA kernel


@dataclasses.dataclass(frozen=True)
class MlaPadding:
    """The index maps of one padding (see the module docstring): rope_src[j] is the old rotary
    column that new column rope_dst[j] takes; q_scale the power of two on the query weights."""

    cfg: ModelConfig
    new: ModelConfig
    copies: int
    rope_src: np.ndarray
    rope_dst: np.ndarray
    q_scale: float


def _refuse(cfg: ModelConfig, why: str) -> ConfigError:
    return ConfigError(
        f"--pad-mla-for-vllm: cannot pad kv_lora_rank={cfg.kv_lora_rank}, qk_rope_head_dim="
        f"{cfg.qk_rope_head_dim} exactly: {why}"
    )


def plan_padding(cfg: ModelConfig, latent: int = VLLM_MLA_LATENT, rope: int = VLLM_MLA_ROPE) -> MlaPadding:
    """The padded config and index maps, or a ConfigError saying why no exact padding exists."""
    if cfg.attention_type != "mla":
        raise ConfigError(
            f"--pad-mla-for-vllm applies to MLA models; this one has attention_type={cfg.attention_type!r}"
        )
    r, d, nope = cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.qk_nope_head_dim
    if r > latent or d > rope:
        raise _refuse(cfg, f"padding only grows dimensions, and vLLM's MLA kernel takes {latent} + {rope}")
    if latent % r:
        raise _refuse(
            cfg,
            f"the latent must repeat whole ({latent} is not a multiple of {r}); zero-padding it instead "
            f"changes the RMSNorm's eps by {latent}/{r}",
        )
    if rope % d:
        raise _refuse(cfg, f"pair i must land on pair i * {rope}/{d}, and {rope} is not a multiple of {d}")
    stride = rope // d
    rs = export_rope(cfg, rope)
    if rs is None:
        raise _refuse(
            cfg,
            f"no YaRN fields give frequencies at rope dimension {rope} whose every {stride}-th pair equals "
            f"the model's (truncate={cfg.rope_scaling.truncate}: the ramp bounds cannot be placed)",
        )
    m = 0
    while (4**m) * (nope + d) < nope + rope:
        m += 1
    new_nope = (4**m) * (nope + d) - rope
    pairs = np.arange(d // 2)
    # old columns of pair i: (2i, 2i+1) interleaved, (i, i + d/2) half-split; new: (2si, 2si+1)
    first = 2 * pairs if cfg.rope_interleave else pairs
    second = first + 1 if cfg.rope_interleave else pairs + d // 2
    src = np.stack([first, second], axis=1).reshape(-1)
    dst = np.stack([2 * stride * pairs, 2 * stride * pairs + 1], axis=1).reshape(-1)
    new = dataclasses.replace(
        cfg,
        kv_lora_rank=latent,
        qk_rope_head_dim=rope,
        qk_nope_head_dim=new_nope,
        rope_interleave=True,
        rope_scaling=rs.scaling,
    )
    validate_model(new)
    return MlaPadding(cfg, new, latent // r, src, dst, float(2**m))


def _pad_query(w: np.ndarray, p: MlaPadding) -> np.ndarray:
    """[..., heads, nope + d] -> [..., heads, nope' + D], times the power of two."""
    old, new = p.cfg, p.new
    out = np.zeros(w.shape[:-1] + (new.qk_head_dim,), w.dtype)
    out[..., : old.qk_nope_head_dim] = w[..., : old.qk_nope_head_dim]
    out[..., new.qk_nope_head_dim + p.rope_dst] = w[..., old.qk_nope_head_dim + p.rope_src]
    return (out * np.asarray(p.q_scale, w.dtype)).astype(w.dtype)


def _pad_kv_a(w: np.ndarray, p: MlaPadding) -> np.ndarray:
    """[..., embed, r + d] -> [..., embed, R + D]: the latent repeated, the rotary key mapped."""
    r, R = p.cfg.kv_lora_rank, p.new.kv_lora_rank
    out = np.zeros(w.shape[:-1] + (R + p.new.qk_rope_head_dim,), w.dtype)
    out[..., :R] = np.tile(w[..., :r], (1,) * (w.ndim - 1) + (p.copies,))
    out[..., R + p.rope_dst] = w[..., r + p.rope_src]
    return out


def _pad_norm(w: np.ndarray, p: MlaPadding) -> np.ndarray:
    out = np.zeros(w.shape[:-1] + (p.new.kv_lora_rank,), w.dtype)
    out[..., : p.cfg.kv_lora_rank] = w
    return out


def _pad_kv_b(w: np.ndarray, p: MlaPadding) -> np.ndarray:
    """[..., r, heads, nope + v] -> [..., R, heads, nope' + v]: the first latent copy only."""
    old, new = p.cfg, p.new
    lead = w.shape[:-3]
    out = np.zeros(lead + (new.kv_lora_rank, w.shape[-2], new.qk_nope_head_dim + new.v_head_dim), w.dtype)
    out[..., : old.kv_lora_rank, :, : old.qk_nope_head_dim] = w[..., : old.qk_nope_head_dim]
    out[..., : old.kv_lora_rank, :, new.qk_nope_head_dim :] = w[..., old.qk_nope_head_dim :]
    return out


_PADDERS = {"q": _pad_query, "q_b": _pad_query, "kv_a": _pad_kv_a, "kv_a_norm": _pad_norm, "kv_b": _pad_kv_b}


def _pad_tree(tree: Any, p: MlaPadding) -> Any:
    if not isinstance(tree, dict):
        return tree
    if "kv_a" in tree and "kv_b" in tree:  # one attention block's parameters
        return {k: (_PADDERS[k](np.asarray(jax.device_get(v)), p) if k in _PADDERS else v) for k, v in tree.items()}
    return {k: _pad_tree(v, p) for k, v in tree.items()}


def pad_mla(
    cfg: ModelConfig, params: dict, latent: int = VLLM_MLA_LATENT, rope: int = VLLM_MLA_ROPE
) -> tuple[ModelConfig, dict]:
    """(padded config, padded host parameters) computing what (cfg, params) compute (module
    docstring); unchanged when the sizes already match. Raises ConfigError when no exact padding
    exists, saying why."""
    if cfg.attention_type == "mla" and (cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.rope_interleave) == (
        latent,
        rope,
        True,
    ):
        return cfg, params
    plan = plan_padding(cfg, latent, rope)
    return plan.new, _pad_tree(params, plan)
