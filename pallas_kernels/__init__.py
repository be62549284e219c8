"""Pallas GPU kernels for the MoE matmuls (MXFP8 / NVFP4 quantise and grouped matmul).

This package is where the kernels go, outside `src/composer_jax`, so that they can be lowered for
CUDA and run in interpret mode on a CPU-only machine and replaced independently of the model. No
kernel is implemented yet: the low-precision MoE work (quant/ and these kernels) is a later issue;
until then the model's MoE matmuls run through XLA (`model/moe.py`).
"""
