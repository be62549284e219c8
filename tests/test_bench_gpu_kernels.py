"""bench/gpu_kernels.py: its CPU mode (`--interpret --small`) runs every kernel and passes every
check without printing a speed; `--lowering` reports what this JAX lowers for CUDA; without a GPU
the full benchmark refuses with a message saying how to run it."""

import contextlib
import io
import re
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import gpu_kernels  # noqa: E402

KERNELS = [
    "mxfp8_quantize axis=1",
    "mxfp8_quantize axis=0",
    "nvfp4_quantize per token",
    "grouped_matmul_mxfp8",
    "grouped_matmul_nvfp4",
    "grouped_matmul_mxfp8_dgrad",
    "grouped_matmul_mxfp8_wgrad",
    "moe layer mxfp8 pallas == xla",
    "moe layer nvfp4_fwd_mxfp8_bwd pallas == xla",
]


def _main(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = gpu_kernels.main(argv)
    return rc, out.getvalue()


@pytest.mark.slow  # ~60 s of CPU: every kernel and the MoE layer compiled in interpret mode
def test_small_interpret_mode_checks_every_kernel_and_claims_no_speed():
    rc, printed = _main(["--interpret", "--small"])
    assert rc == 0, printed
    for name in KERNELS:
        assert f"PASS {name}" in printed, name
    assert "9/9 checks passed" in printed
    assert not re.search(r"\d+(\.\d+)? (TFLOP/s|ms)", printed)  # no speed printed
    assert printed.count("ran (interpret mode: no timing)") == 14  # 2 projections x 7 products


def test_lowering_report_says_what_this_jax_lowers_for_cuda():
    rc, printed = _main(["--lowering"])
    assert rc == 0
    lines = {line[7:].split(" | ")[0]: line[:6].strip() for line in printed.splitlines()}
    assert lines["triton: fp8 x fp8 dot, f32 accumulate"] == "LOWERS"
    assert lines["mosaic gpu: fp8 wgmma, B K-major ([N, K] in memory)"] == "LOWERS"
    # 8-bit wgmma takes no transposed operand: a [K, N] weight must be stored K-major first
    assert lines["mosaic gpu: fp8 wgmma, B N-major ([K, N] in memory)"] == "FAILS"
    assert "Only f16 WGMMA supports transposes" in printed


def test_full_benchmark_without_a_gpu_refuses_and_bad_models_are_named(capsys):
    with pytest.raises(SystemExit):
        gpu_kernels.main([])
    assert "--interpret --small" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_kernels.main(["--models", "llama"])
    err = capsys.readouterr().err
    assert "'llama'" in err and "deepseek_v3, kimi_k2" in err
