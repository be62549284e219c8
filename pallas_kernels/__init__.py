"""Pallas GPU kernels for the MoE matmuls (MXFP8 / NVFP4 quantise and grouped matmul).

Kernels live here, outside `src/composer_jax`, so that they can be lowered and tested for CUDA on a
CPU-only machine (interpret mode and `lower(lowering_platforms=("cuda",))`) and swapped for newer
Mosaic GPU versions without touching the model; `composer_jax.quant` selects them by backend.
"""
