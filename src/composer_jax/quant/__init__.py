"""Low-precision MoE: block-scaled formats (MXFP8, MXFP4, NVFP4 with a per-tensor or per-token
second-level scale) and the quantised grouped matmul used by the MoE dispatch paths."""

from __future__ import annotations

from composer_jax.quant.formats import (
    E2M1,
    E4M3,
    E5M2,
    FORMATS,
    QuantArray,
    dequantize,
    fake_quantize,
    mx_quantize,
    nvfp4_quantize,
    pack_fp4,
    quantize,
    round_to_format,
    unpack_fp4,
)

__all__ = [
    "E2M1",
    "E4M3",
    "E5M2",
    "FORMATS",
    "QuantArray",
    "dequantize",
    "fake_quantize",
    "mx_quantize",
    "nvfp4_quantize",
    "pack_fp4",
    "quantize",
    "round_to_format",
    "unpack_fp4",
]
