"""Pallas GPU kernels for the MoE matmuls (MXFP8 / NVFP4 quantise and grouped matmul).

This package is where the kernels go, outside `src/composer_jax`, so that they can be lowered for
CUDA and run in interpret mode on a CPU-only machine and replaced independently of the model. It
imports only JAX (and einops, whose patterns name the twins' block and nibble layouts). Every
kernel has a jnp reference twin next to it.

- `mx_quant.mxfp8_quantize`: MXFP8 E4M3 quantisation, row-wise or column-wise, OCP or round-up
  scale rule (Triton-style Pallas); twin `mxfp8_quantize_ref`, equal bit for bit to
  `composer_jax.quant.formats.mx_quantize`.
- `nvfp4_quant.nvfp4_quantize`: NVFP4 with a per-token second-level scale, FP4 packed two per
  byte; twin `nvfp4_quantize_ref`, equal bit for bit to `quant.formats.nvfp4_quantize(...,
  second="token")`.

- `grouped_matmul.grouped_matmul_mxfp8` / `grouped_matmul_nvfp4`: grouped matmuls over expert
  groups whose sizes are known only at run time, MXFP8 or NVFP4 (per-token second scale) operands
  with the scales applied in the kernel (Triton, Hopper-class); twins `*_ref`.

- `grouped_matmul_bwd.grouped_matmul_mxfp8_dgrad` (dy @ w^T per group, MXFP8 along N) and
  `grouped_matmul_mxfp8_wgrad` (x^T @ dy per group over the group-padded layout, MXFP8 along the
  rows, a ragged contraction), twins `*_ref`.

`composer_jax.quant.pallas_backend` wires these in as the "pallas" backend of the quantised MoE
matmuls (`model.moe_quant_backend`). Not yet here: a Blackwell (tcgen05 block-scaled MMA) path.
"""
