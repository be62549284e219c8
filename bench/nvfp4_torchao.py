"""NVFP4 with a per-tensor second-level scale (`composer_jax.quant.formats.nvfp4_quantize`) against
torchao's own `nvfp4_quantize` (torchao.prototype.mx_formats, 0.18), on random heavy-tailed tensors.

torchao is not a dependency of the project; install it beside the venv without its dependencies
(it runs on the CPU torch the venv pins):

    .venv/bin/pip install --no-deps --target /tmp/torchao torchao==0.18.0
    PYTHONPATH=src:/tmp/torchao .venv/bin/python bench/nvfp4_torchao.py [--tensors 200]

Printed: how many second-level scales differ (and how many the plain jitted `amax / 2688` would
have had wrong: XLA multiplies by the rounded reciprocal), and how many block scales and dequantised
values differ where torchao's clamp of block scales at E4M3's smallest normal 2^-6 does not apply
(below it the project keeps E4M3 subnormals, a choice listed in formats.py's docstring).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

from composer_jax.quant import formats as F


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", type=int, default=200, help="random [16, 256] tensors (default 200)")
    args = p.parse_args()
    try:
        import torch
        from torchao.prototype.mx_formats.kernels import f4_unpacked_to_f32, unpack_uint4
        from torchao.prototype.mx_formats.nvfp4_tensor import nvfp4_quantize, per_tensor_amax_to_scale
    except ImportError as e:
        raise SystemExit(f"torchao 0.18 is needed ({e}); see this script's docstring for the install line") from None
    rng = np.random.default_rng(0)
    naive = jax.jit(lambda a: a / (448.0 * 6.0))
    counts = dict.fromkeys(("s2_differ", "naive_s2_differ", "scales", "scales_differ", "values", "values_differ"), 0)
    for _ in range(args.tensors):
        x = (rng.standard_t(4, size=(16, 256)) * 10.0 ** rng.uniform(-3, 3)).astype(np.float32)
        amax = np.float32(np.abs(x).max())
        s2_ao = float(per_tensor_amax_to_scale(torch.tensor(amax)))
        q = F.nvfp4_quantize(jnp.asarray(x), axis=-1, second="tensor")
        counts["s2_differ"] += float(q.second.reshape(())) != s2_ao
        counts["naive_s2_differ"] += float(naive(jnp.float32(amax))) != s2_ao
        sc_ao, data_ao = nvfp4_quantize(torch.from_numpy(x), 16, torch.tensor(s2_ao, dtype=torch.float32))
        sc_ao = sc_ao.to(torch.float32).numpy().reshape(16, 16)
        kept = sc_ao > 2.0**-6
        sc = np.asarray(q.scales.astype(jnp.float32)).reshape(16, 16)
        counts["scales"] += int(kept.sum())
        counts["scales_differ"] += int((sc[kept] != sc_ao[kept]).sum())
        e2m1 = f4_unpacked_to_f32(unpack_uint4(data_ao)).numpy().reshape(16, 16, 16)
        v_ao = e2m1 * sc_ao[..., None] * np.float32(s2_ao)
        v = np.asarray(q.dequantize()).reshape(16, 16, 16)
        m = np.broadcast_to(kept[..., None], v.shape)
        counts["values"] += int(m.sum())
        counts["values_differ"] += int((v[m] != v_ao[m]).sum())
    n = args.tensors
    print(
        f"second-level scales differing from torchao: {counts['s2_differ']} of {n} (a jitted amax / 2688: "
        f"{counts['naive_s2_differ']})"
    )
    print(f"block scales differing (both >= 2^-6): {counts['scales_differ']:,} of {counts['scales']:,}")
    print(f"dequantised values differing in those blocks: {counts['values_differ']:,} of {counts['values']:,}")


if __name__ == "__main__":
    main()
