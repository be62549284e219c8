"""Observability: JSONL + TensorBoard event logs, a console progress bar with ETA, MFU.

The report finds that held-out codebase perplexity falls log-linearly and predicts RL reward, so
the loop evaluates it on a fixed held-out set at an interval and logs it per stage.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def measure_peak_flops(n: int = 1024, repeats: int = 3) -> float:
    """Per-device float32 matmul throughput (FLOP/s) of this machine, as the MFU denominator."""
    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best


def scalars(metrics: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
    """Flatten metrics to named scalars: vectors become name/i, per-expert matrices are summarised
    (load imbalance max/mean per layer, bias spread) rather than dumped."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        a = np.asarray(v)
        if k == "expert_counts":
            load = a / np.maximum(a.mean(-1, keepdims=True), 1e-9)
            for layer, row in enumerate(load):
                out[f"{prefix}moe/layer{layer}/max_load"] = float(row.max())
                out[f"{prefix}moe/layer{layer}/min_load"] = float(row.min())
        elif k == "router_bias":
            out[f"{prefix}moe/bias_std"] = float(a.std())
            out[f"{prefix}moe/bias_absmax"] = float(np.abs(a).max())
        elif a.ndim == 0:
            out[prefix + k] = float(a)
        elif a.ndim == 1:
            for i, x in enumerate(a):
                out[f"{prefix}{k}/{i + 1}"] = float(x)
    return out


class RunLogger:
    """Writes every logged step to `out_dir/metrics.jsonl` and TensorBoard event files."""

    def __init__(self, out_dir: str | Path, stage: str, tensorboard: bool = True, enabled: bool = True):
        self.enabled = enabled
        self.stage = stage
        self.dir = Path(out_dir)
        self._tb = None
        if not enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = open(self.dir / "metrics.jsonl", "a", buffering=1)
        if tensorboard:
            from tensorboardX import SummaryWriter

            self._tb = SummaryWriter(str(self.dir / "tensorboard"))

    def log(self, step: int, values: Mapping[str, float], raw: Mapping[str, Any] | None = None) -> None:
        if not self.enabled:
            return
        record = {"stage": self.stage, "step": int(step), "time": time.time(), **values}
        if raw:
            record.update({k: np.asarray(v).tolist() for k, v in raw.items()})
        self._jsonl.write(json.dumps(record) + "\n")
        if self._tb is not None:
            for k, v in values.items():
                if math.isfinite(v):
                    self._tb.add_scalar(f"{self.stage}/{k}", v, int(step))

    def note(self, step: int, fields: Mapping[str, Any]) -> None:
        """A record of non-scalar fields (e.g. {"init": {...}}) in metrics.jsonl only."""
        if self.enabled:
            self._jsonl.write(
                json.dumps({"stage": self.stage, "step": int(step), "time": time.time(), **fields}) + "\n"
            )

    def close(self) -> None:
        if self.enabled:
            self._jsonl.close()
            if self._tb is not None:
                self._tb.close()


class Progress:
    """One console line per update: step, loss, throughput and ETA (a full line when not a tty)."""

    def __init__(self, total: int, start: int, stream=None):
        # sys.stdout as of the call, not of this module's import (a test's capture may have closed that one)
        self.total, self.start, self.stream = total, start, stream if stream is not None else sys.stdout
        self.t0 = time.perf_counter()
        self.tty = self.stream.isatty()

    def update(self, step: int, text: str) -> None:
        done = step - self.start
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / max(done, 1) * (self.total - step)
        width = 24
        filled = int(width * step / max(self.total, 1))
        bar = "#" * filled + "-" * (width - filled)
        line = f"[{bar}] {step}/{self.total} {text} | ETA {eta:5.0f}s"
        if self.tty:
            self.stream.write("\r" + line[:200])
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.tty:
            self.stream.write("\n")
