"""bench/gpu_check.py (issue 42): its dry run runs the sections on CPU at tiny shapes and writes the
JSON and Markdown report a device run would; the wheels a device call carries fit its 64 MiB and are
the versions the project pins; a bad section is named."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import gpu_check  # noqa: E402


def _check(results: dict, sections: list[str]) -> None:
    assert list(results["sections"]) == ["env", *sections]
    for name, sec in results["sections"].items():
        assert sec["status"] == "ok", (name, sec.get("error"), sec.get("checks"))


def test_dry_run_measures_the_train_step_and_decode_and_writes_the_report(tmp_path):
    """The train section steps both recipes (bf16, MXFP8 through the Pallas kernels, interpreted
    here) on the transformers-made model; decode runs both sides on the same weights. No MFU without
    a known GPU peak. (The kernels and sharded sections: the slow test below; their properties are
    kept by default by tests/quant/test_pallas_*.py and tests/train/test_step_sharded.py.)"""
    results = gpu_check.run(["--dry-run", "--out", str(tmp_path), "--sections", "train,decode"])
    _check(results, ["train", "decode"])
    steps = results["sections"]["train"]["steps"]
    assert [s["recipe"] for s in steps] == ["bf16", "mxfp8"]
    for s in steps:
        assert s["step_s"] > 0 and s["mfu"] is None and s["inspect_estimate_bytes"] > 0
    rows = results["sections"]["decode"]["batches"]
    assert [r["batch"] for r in rows] == [2] and all(r["ours_tok_s"] > 0 for r in rows)
    assert all(0.0 <= r["greedy_agreement"] <= 1.0 for r in rows)
    saved = json.loads((tmp_path / "gpu_check.json").read_text())
    assert saved["sections"]["train"]["steps"][0]["recipe"] == "bf16"
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| train | ok |" in md and "## Train step" in md and "## Decode" in md


@pytest.mark.slow  # ~2 min of CPU: every kernel interpreted and two sharded gradient programs
def test_dry_run_of_every_section(tmp_path):
    results = gpu_check.run(["--dry-run", "--out", str(tmp_path)])
    _check(results, list(gpu_check.SECTIONS))
    names = [c[0] for c in results["sections"]["sharded"]["checks"]]
    assert names == ["sharded == unsharded: host cpu mesh expert2 x context2"]


def test_a_section_that_raises_is_reported_and_the_run_fails(tmp_path, monkeypatch):
    def broken(plan):
        raise RuntimeError("kernel exploded")

    monkeypatch.setitem(gpu_check.RUNNERS, "sharded", broken)
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path), "--sections", "sharded"]) == 1
    md = (tmp_path / "gpu_check.md").read_text()
    assert "| sharded | raised |" in md and "kernel exploded" in md


def test_bad_sections_and_no_gpu_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu_check.run(["--dry-run", "--out", str(tmp_path), "--sections", "train,warp"])
    assert "['warp'] not accepted; accepted: kernels, train, decode, sharded" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        gpu_check.run(["--out", str(tmp_path)])
    assert "run with --dry-run on CPU" in capsys.readouterr().err


def test_carried_wheels_fit_a_device_call_and_match_the_pins():
    """bench/gpu_wheels.txt: the recorded sizes fit the device call's 64 MiB beside the working tree,
    and each wheel the project itself pins (locks/base.lock) is that version."""
    lines = [ln.split() for ln in (ROOT / "bench/gpu_wheels.txt").read_text().splitlines() if ln and ln[0] != "#"]
    assert sum(int(size) for _, size in lines) < 16 * 2**20  # leaves the rest of the 64 MiB to the tree
    pins = dict(
        re.match(r"([A-Za-z0-9_.-]+)==(\S+)", ln).groups()
        for ln in (ROOT / "locks/base.lock").read_text().splitlines()
        if re.match(r"[A-Za-z0-9_.-]+==", ln)
    )
    norm = {re.sub(r"[-_.]+", "-", k).lower(): v for k, v in pins.items()}
    wanted = {re.sub(r"[-_.]+", "-", n).lower(): v for n, v in (spec.split("==") for spec, _ in lines)}
    for name in ("grain", "array-record", "tensorboardx"):
        assert wanted[name] == norm[name], name
