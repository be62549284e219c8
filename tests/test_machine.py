"""What machine a timing was taken on (machine.py; issue 53, item 3): the CPU model as `lscpu`
reads it, the calibration's rate against a numpy matmul of the same size timed here, the line the
demo prints, and the report's line from the demo's machine.json."""

from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest

from composer_jax import machine
from composer_jax.report import write_report


@pytest.mark.skipif(shutil.which("lscpu") is None, reason="no lscpu here")
def test_the_cpu_model_is_lscpus():
    out = subprocess.run(["lscpu"], capture_output=True, text=True, env={"LC_ALL": "C"}, check=True).stdout
    (model,) = [ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name:")][:1]
    assert machine.cpu_model() == model


def test_the_calibration_is_a_matmuls_rate(monkeypatch):
    live = machine.calibrate(seconds=0.2, n=128)
    assert np.isfinite(live) and live > 0
    # a clock that advances 10 ms a reading: each timed product reads 10 ms, so the rate is
    # 2 n^3 / 10 ms, worked by hand: 2 x 128^3 = 4,194,304 FLOP / 0.01 s = 0.4194304 GFLOP/s
    now = iter(np.arange(0.0, 1000.0, 0.01))
    monkeypatch.setattr(machine.time, "perf_counter", lambda: float(next(now)))
    assert machine.calibrate(seconds=0.2, n=128) == pytest.approx(0.4194304)


def test_the_line_and_the_reports_line(tmp_path):
    m = {"cpu": "AMD EPYC 7B13", "cores": 2, "calibration_gflops": 61.26, "calibration": "..."}
    assert machine.line(m) == "AMD EPYC 7B13 (2 cores, 61.3 GFLOP/s float32 matmul)"
    assert machine.line({**m, "cores": 1}) == "AMD EPYC 7B13 (1 core, 61.3 GFLOP/s float32 matmul)"
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"stage": "stage1", "step": 1, "time": 0.0, "loss": 5.0}))
    (tmp_path / "machine.json").write_text(json.dumps({**m, "wall_s": 2043.4}))
    md = write_report(tmp_path).read_text()
    assert "Machine: wall time 34m03s on AMD EPYC 7B13, 2 cores, 61.3 GFLOP/s float32 matmul." in md
    (tmp_path / "machine.json").write_text("{not json")
    assert "Machine:" not in write_report(tmp_path).read_text()  # a broken file: no line, no crash
