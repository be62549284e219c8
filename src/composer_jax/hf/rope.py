"""YaRN fields an export can write so that every engine computes the project's rotary frequencies
over the whole context the model serves.

The project (`model/layers.py`), transformers and vLLM compute the same YaRN frequencies from
(theta, factor, original_max_position_embeddings, beta_fast, beta_slow); but vLLM's DeepSeek YaRN
tabulates cos/sin for `original_max_position_embeddings * factor` positions only and fails at any
position past it, while it admits requests up to `max_position_embeddings`. A model whose
`max_position_embeddings` exceeds that product (a run extended with factor 2 from 256 and kept at
the 4,096 default) therefore needs other fields. `original_max_position_embeddings` enters the
frequencies only through the ramp bounds ln(L / (2 pi beta)) scaled, which truncation (`truncate`,
always on in vLLM's DeepSeek YaRN) rounds to integers: so a longer original length L with
beta_fast/beta_slow scaled to put each rounded bound where it was gives bit-identical frequencies.
`export_rope` writes L = ceil(max_position_embeddings / factor) with such betas, checked with the
project's own `rope_frequencies`. Without truncation the bounds are continuous and only the trained
fields are exact: the export then caps `max_position_embeddings` at their table (and says so).

The same search serves MLA padding (`hf_pad.py`): frequencies at a larger rotary dimension,
subsampled at every `stride`-th pair, must equal the original ones.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from composer_jax.config import ModelConfig, RopeScalingConfig
from composer_jax.model.layers import rope_frequencies


@dataclasses.dataclass(frozen=True)
class ExportRope:
    """scaling: the fields to write; max_position_embeddings: the context they cover exactly (the
    model's own, or less when no fields cover it); note: why it is less, or None."""

    scaling: RopeScalingConfig
    max_position_embeddings: int
    note: str | None = None


def rope_dim(cfg: ModelConfig) -> int:
    """The rotary dimension: qk_rope_head_dim for MLA, the head dimension for GQA."""
    return cfg.qk_rope_head_dim if cfg.attention_type == "mla" else cfg.head_dim


def same_frequencies(
    dim: int, theta: float, want: RopeScalingConfig, new_dim: int, candidate: RopeScalingConfig
) -> bool:
    """Do `candidate`'s frequencies at `new_dim`, every (new_dim // dim)-th pair, equal `want`'s at
    `dim` bit for bit, with the same magnitude factor (the project's own computation decides)?"""
    ref, ref_factor = rope_frequencies(dim, theta, want)
    got, got_factor = rope_frequencies(new_dim, theta, candidate)
    stride = new_dim // dim
    return ref_factor == got_factor and np.array_equal(ref, got[::stride][: len(ref)])


def _betas_for(dim: int, theta: float, rs: RopeScalingConfig, length: int, stride: int) -> RopeScalingConfig:
    """rs with original length `length` and beta_fast/beta_slow chosen so that the truncated ramp
    bounds at dim * stride are stride times rs's bounds at dim (so every stride-th pair keeps its
    frequency). Each bound is put half a step inside its rounding interval."""
    span = 2 * math.log(theta) / dim  # bound(beta, L, dim) = ln(L / (2 pi beta)) / span

    def bound(rotations: float, orig: float) -> float:
        return math.log(orig / (rotations * 2 * math.pi)) / span

    low = max(math.floor(bound(rs.beta_fast, rs.original_max_position_embeddings)), 0)
    high = min(math.ceil(bound(rs.beta_slow, rs.original_max_position_embeddings)), dim - 1)
    want_low = low + 0.5 / stride if low > 0 else -0.5 / stride  # floor(stride * .) = stride * low (or < 0)
    want_high = high - 0.5 / stride  # ceil(stride * .) = stride * high
    beta = lambda b: length / (2 * math.pi) * math.exp(-b * span)
    return dataclasses.replace(
        rs, original_max_position_embeddings=length, beta_fast=beta(want_low), beta_slow=beta(want_high)
    )


def export_rope(cfg: ModelConfig, new_dim: int | None = None) -> ExportRope | None:
    """YaRN fields that give cfg's frequencies (at `new_dim`, every (new_dim / dim)-th pair, when
    given) and cover cfg.max_position_embeddings if any do; None when no fields reproduce them."""
    rs, dim = cfg.rope_scaling, rope_dim(cfg)
    new_dim = new_dim or dim
    if rs.type != "yarn":
        return ExportRope(rs, cfg.max_position_embeddings)
    max_pos, orig, stride = cfg.max_position_embeddings, rs.original_max_position_embeddings, new_dim // dim
    if stride == 1 and orig * rs.factor >= max_pos:
        return ExportRope(rs, max_pos)
    length = max(orig, math.ceil(max_pos / rs.factor))
    candidates = [dataclasses.replace(rs, original_max_position_embeddings=length)]
    if rs.truncate:  # without truncation the bounds are continuous: only the given fields are exact
        candidates += [_betas_for(dim, cfg.rope_theta, rs, length, stride)]
    candidates += [rs] if stride == 1 else [_betas_for(dim, cfg.rope_theta, rs, orig, stride)] * rs.truncate
    exact = [c for c in candidates if same_frequencies(dim, cfg.rope_theta, rs, new_dim, c)]
    if not exact:
        return None
    best = exact[0]
    reach = int(best.original_max_position_embeddings * best.factor)
    if reach >= max_pos:
        return ExportRope(best, max_pos)
    note = (
        f"max_position_embeddings capped at {reach} (the model's is {max_pos}): with truncate=false "
        f"YaRN's ramp bounds move with original_max_position_embeddings, so only the trained fields "
        f"({orig} x factor {rs.factor}) give the model's frequencies, and vLLM tabulates {reach} positions"
    )
    return ExportRope(best, reach, note)
