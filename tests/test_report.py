"""`composer-jax report`: the Markdown tables against the records written, the PNGs real images."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from PIL import Image

from composer_jax.cli import main as cli_main
from composer_jax.report import ReportError, read_metrics, write_report


def _write(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def _run_dir(tmp_path: Path) -> Path:
    run = tmp_path / "run"
    _write(
        run / "stage1" / "metrics.jsonl",
        [{"stage": "stage1", "step": s, "time": 0.0, "loss": 6.0 - s, "expert_counts": [[1, 2]]} for s in (1, 2, 3)]
        + [{"stage": "stage1", "step": 3, "time": 0.0, "eval/perplexity": 40.5}],
    )
    rl = [
        {
            "stage": "rl",
            "step": s,
            "time": 0.0,
            "reward/total": 0.1 * s,
            "reward/grade": 0.1 * s,
            "reward/length_penalty": -0.01,
            "rollout/success": 0.25 * s,
            "rollout/best_of_k": 1.0,
            "mismatch_kl_k1": 1e-4,
            "version_lag_mean": 0.5,
            "version_lag_max": 1.0,
        }
        for s in (1, 2)
    ]
    rl.append({"stage": "rl", "step": 0, "time": 0.0, "eval/pass@1": 0.5, "eval/reward": 0.5})
    rl.append(
        {
            "stage": "rl",
            "step": 2,
            "time": 0.0,
            "eval/pass@1": 0.75,
            "eval/reward": 0.8,
            "eval/paired_diff": 0.25,
            "eval/paired_se": 0.125,
            "eval/paired_z": 2.0,
        }
    )
    _write(run / "rl" / "metrics.jsonl", rl)
    ev = {
        "overall": {"pass@1": 0.5, "best_of_k": 1.0, "reward": 0.5, "tokens": 120.0},
        "categories": {"gen": {"pass@1": 0.25, "reward": 0.25}},
        "tasks": {},
    }
    (run / "eval").mkdir()
    (run / "eval" / "report.json").write_text(json.dumps(ev))
    return run


def test_report_tables_and_plots(tmp_path):
    run = _run_dir(tmp_path)
    md = write_report(run).read_text()
    assert "| stage1 | 5 -> 3 (steps 1-3) | 40.5 -> 40.5 (steps 3-3) |" in md
    # the RL table: one row per step, the held-out value on the step it was measured
    header = "| step | reward | success | best-of-K | length pen. | lag mean | lag max | mismatch KL | held-out "
    assert header + "pass@1 | paired change | paired se | z |" in md
    assert "| 0 |  |  |  |  |  |  |  | 0.5 |  |  |  |" in md
    assert "| 1 | 0.1 | 0.25 | 1 | -0.01 | 0.5 | 1 | 0.0001 |  |  |  |  |" in md
    assert "| 2 | 0.2 | 0.5 | 1 | -0.01 | 0.5 | 1 | 0.0001 | 0.75 | 0.25 | 0.125 | 2 |" in md
    # above the table: the held-out start -> end with the end's paired change from step 0
    assert "Held-out pass@1 0.5 (step 0) -> 0.75 (step 2); paired change +0.25 (standard error 0.125" in md
    assert "over the held-out tasks, z 2)." in md
    assert "## Evaluation: eval" in md and "| overall | 0.5 | 1 | 0.5 | 120 |" in md
    assert "| gen | 0.25 |  | 0.25 |  |" in md
    for name in ("pretraining", "rl"):
        with Image.open(run / "plots" / f"{name}.png") as im:
            assert im.format == "PNG" and im.size[0] > 300 and im.size[1] > 200
        assert f"plots/{name}.png" in md


def test_read_metrics_keeps_last_value_of_a_repeated_step(tmp_path):
    p = tmp_path / "metrics.jsonl"
    _write(p, [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}, {"step": 2, "loss": 1.5, "flag": True}])
    assert read_metrics(p) == {"loss": [(1, 3.0), (2, 1.5)]}


def test_bad_run_dirs(tmp_path, capsys):
    assert cli_main(["report", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli_main(["report", str(tmp_path)]) == 2
    assert "holds no metrics.jsonl" in capsys.readouterr().err
    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\nnot json\n')
    with pytest.raises(ReportError, match=r"metrics.jsonl:2: not a metrics record"):
        write_report(tmp_path)
