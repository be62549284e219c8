"""What machine a timing was taken on: its CPU model, the cores this process may use, and a
one-second calibration (a fixed float32 matmul's GFLOP/s on one JAX device), so that a wall time
reads with its machine: a slow demo on a slow CPU reads as such (issue 53, item 3).

`probe()` measures; `line(probe)` is the one line the demo prints beside its wall time and writes to
`machine.json` in its output folder (`composer-jax report` shows it). The benches print the same.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any

CALIBRATION_N = 512  # the matmul's side: 2 n^3 = 0.27 GFLOP a product, ~10 ms on a 2020s core
CALIBRATION_S = 1.0


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo's first `model name`, else the platform's), or "unknown"."""
    try:
        for text in Path("/proc/cpuinfo").read_text().splitlines():
            if text.startswith("model name"):
                return text.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def usable_cores() -> int:
    """The cores this process may run on (its affinity set; the machine's count without one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def calibrate(seconds: float = CALIBRATION_S, n: int = CALIBRATION_N) -> float:
    """float32 GFLOP/s of `x @ x` (n x n) on JAX's first device, repeated for about `seconds` after
    one compiled warm-up run; the median product's rate (a stray slow one does not set it)."""
    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    x = jax.device_put(jnp.full((n, n), 1.0 / n, jnp.float32), device)
    f = jax.jit(lambda a: a @ a)
    f(x).block_until_ready()
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 3:
        t0 = time.perf_counter()
        f(x).block_until_ready()
        times.append(time.perf_counter() - t0)
    times.sort()
    return 2 * n**3 / times[len(times) // 2] / 1e9


def probe(seconds: float = CALIBRATION_S) -> dict[str, Any]:
    """The machine's description: {"cpu", "cores", "calibration_gflops", "calibration"}."""
    return {
        "cpu": cpu_model(),
        "cores": usable_cores(),
        "calibration_gflops": round(calibrate(seconds), 2),
        "calibration": f"float32 {CALIBRATION_N}x{CALIBRATION_N} matmul on one JAX device, median of {seconds:g} s",
    }


def line(m: dict[str, Any]) -> str:
    """One line: `CPU (N cores, G GFLOP/s float32 matmul)`."""
    cores = m["cores"]
    return f"{m['cpu']} ({cores} core{'' if cores == 1 else 's'}, {m['calibration_gflops']:.1f} GFLOP/s float32 matmul)"
