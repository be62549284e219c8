"""`composer-jax report`: the Markdown tables against the records written, the PNGs real images."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from PIL import Image

from composer_jax.cli import main as cli_main
from composer_jax.report import GRID_COLUMNS, ReportError, format_trend, grid, read_metrics, trend, write_report


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


def test_trend_against_hand_worked_examples():
    # (0,1) (1,3) (2,2) (3,5): mean x 1.5, mean y 2.75, Sxx 5, Sxy 5.5 -> slope 1.1; fitted 1.1 2.2 3.3 4.4,
    # residuals -0.1 0.8 -1.3 0.6, SSR 2.7 over 2 degrees of freedom: se sqrt(1.35 / 5) = sqrt(0.27)
    t = trend([(0, 1.0), (1, 3.0), (2, 2.0), (3, 5.0)])
    assert (t.n, t.quarter) == (4, 1)
    assert abs(t.slope - 1.1) < 1e-12 and abs(t.slope_se - math.sqrt(0.27)) < 1e-12
    assert (t.head_mean, t.tail_mean) == (1.0, 5.0) and math.isnan(t.head_se) and math.isnan(t.tail_se)
    # eight steps 0..7, y = 1 3 2 2 4 4 6 8: Sxx 42, Sxy 36, Syy 37.5 -> slope 6/7, SSR 37.5 - 36^2/42 over 6;
    # quarters of two: 1, 3 (mean 2, sd sqrt 2, se 1) and 6, 8 (mean 7, se 1)
    t = trend(list(enumerate([1.0, 3.0, 2.0, 2.0, 4.0, 4.0, 6.0, 8.0])))
    assert abs(t.slope - 6 / 7) < 1e-12
    assert abs(t.slope_se - math.sqrt((37.5 - 36**2 / 42) / 6 / 42)) < 1e-12
    assert t.quarter == 2 and (t.head_mean, t.head_se, t.tail_mean, t.tail_se) == (2.0, 1.0, 7.0, 1.0)
    assert abs(t.z - (6 / 7) / t.slope_se) < 1e-12
    assert (
        format_trend(t)
        == "slope +0.857 +- 0.162 /step (z 5.3, 8 steps); first quarter 2.000 +- 1.000 -> last 7.000 +- 1.000 (2 each)"
    )
    # a noisy curve whose last point is below its first, rising all the same
    t = trend(list(enumerate([0.3, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.2])))
    assert t.slope > 0 and t.tail_mean > t.head_mean
    with pytest.raises(ValueError, match="at least 2 distinct steps"):
        trend([(3, 1.0), (3, 2.0)])


def test_report_prints_trends(tmp_path):
    run = tmp_path / "run"
    _write(run / "s1" / "metrics.jsonl", [{"step": s, "loss": y} for s, y in enumerate([1.0, 3.0, 2.0, 5.0])])
    rl = [{"step": s, "reward/total": y, "rollout/success": y} for s, y in enumerate([1.0, 3.0, 2.0, 5.0])]
    _write(run / "rl" / "metrics.jsonl", rl)
    md = write_report(run).read_text()
    # quarters of one point have no spread: their means print alone, not "+- nan"
    hand = "slope +1.1000 +- 0.5196 /step (z 2.1, 4 steps); first quarter 1.0000 -> last 5.0000"
    assert f"| s1 | 1 -> 5 (steps 0-3) |  | {hand} (1 each) |" in md
    assert "- reward: slope +1.100 +- 0.520 /step (z 2.1, 4 steps); first quarter 1.000 -> last 5.000 (1 each)" in md
    assert "nan" not in md


def test_one_point_quarters_and_a_two_point_slope_print_no_spread():
    t = trend([(0, 1.0), (1, 3.0)])
    assert math.isnan(t.slope_se) and math.isnan(t.head_se)
    assert format_trend(t) == "slope +2.000 /step (2 steps); first quarter 1.000 -> last 3.000 (1 each)"


def test_figure_grid_wraps_panels_onto_rows():
    assert GRID_COLUMNS == 3
    assert grid([6]) == (2, 3, [0])  # the RL figure: six panels as 2 x 3
    assert grid([2, 3, 2]) == (3, 3, [0, 1, 2])  # a stage a row
    assert grid([6, 2]) == (3, 3, [0, 2])  # a stage starts on a row of its own
    assert grid([2, 2]) == (2, 2, [0, 1])  # no wider than the widest stage
    assert grid([7], max_cols=2) == (4, 2, [0])


def test_rl_figure_is_a_readable_grid(tmp_path):
    # all six RL panels with data: 2 rows x 3 columns of 420 x 300 pixels, not one 2520 x 300 strip
    run = tmp_path / "run"
    keys = ("reward/total", "rollout/success", "reward/length_penalty", "version_lag_mean")
    keys += ("rl/dropped_stale_groups", "mismatch_kl_k1")
    _write(run / "rl" / "metrics.jsonl", [{"step": s, **{k: 0.1 * s for k in keys}} for s in (1, 2, 3)])
    write_report(run)
    with Image.open(run / "plots" / "rl.png") as im:
        assert im.size == (1260, 600)


def test_a_mixture_stage_gets_its_sources_train_nll_table_and_panel(tmp_path):
    run = tmp_path / "run"
    recs = [
        {"stage": "sft", "step": s, "time": 0.0, "loss": 1.0, "source_nll/tasks": 2.0 + s, "source_tokens/tasks": 9}
        for s in (1, 2, 3)
    ]
    for r in recs[:2]:  # a source without targets in step 3 has no nll that step
        r["source_nll/family"] = 0.5
    _write(run / "sft" / "metrics.jsonl", recs)
    md = write_report(run).read_text()
    assert "| stage | source | train nll | trend |" in md
    assert "| sft | family | 0.5 -> 0.5 (steps 1-2) |  |" in md
    assert "| sft | tasks | 3 -> 5 (steps 1-3) | " in md and "slope +1" in md
    with Image.open(run / "plots" / "pretraining.png") as im:
        three_panels = im.size[0]
    _write(run / "sft" / "metrics.jsonl", [{k: v for k, v in r.items() if "source" not in k} for r in recs])
    md = write_report(run).read_text()
    assert "| stage | source |" not in md
    with Image.open(run / "plots" / "pretraining.png") as im:
        assert im.size[0] < three_panels  # the source panel is gone with its data


def test_where_the_time_goes_table(tmp_path):
    """The RL stage's profile (runtime/profile.py's keys) as one row per step and per evaluation, in run
    order (the step-0 evaluation first, an evaluation after the step it follows), with the per-step
    means above; a stage without profile values has no such table."""
    prof = {"profile/sampler_prefill_s": 1.0, "profile/sampler_decode_s": 20.0, "profile/env_grade_s": 4.0}
    rl = [
        {"stage": "rl", "step": 0, "time": 0.0, "eval/pass@1": 0.5, "eval/profile/wall_s": 30.0},
        {"stage": "rl", "step": 0, "time": 0.0, "eval/profile/core0_busy": 0.25, "eval/profile/core1_busy": 1.0},
    ]
    for s, wall, busy in ((1, 40.0, 0.5), (2, 60.0, 0.75)):
        rl.append(
            {
                "stage": "rl",
                "step": s,
                "time": 0.0,
                "reward/total": 0.1,
                "rollout/success": 0.5,
                "time/wait_s": wall - 10.0,
                "time/update_s": 5.0,
                "profile/wall_s": wall,
                "profile/core0_busy": busy,
                "profile/core1_busy": 1.0,
                **prof,
            }
        )
    rl.append({"stage": "rl", "step": 2, "time": 0.0, "eval/pass@1": 0.75, "eval/profile/wall_s": 35.0})
    run = tmp_path / "run"
    _write(run / "rl" / "metrics.jsonl", rl)
    md = write_report(run).read_text()
    assert "#### Where the time goes" in md
    # means of steps 1 and 2: wall 50, waits 40, update 5; core 0 busy 62.5% (printed 62%), core 1 100%
    assert (
        "where the time goes, mean of 2 step(s): wall 50 s (trainer waits 40 s, update 5 s); sampler prefill 1 s, "
        "decode 20 s; environment grading 4 s (summed over concurrent calls); cores busy 0 62%, 1 100%"
    ) in md
    header = "| | wall s | trainer waits s | update s | prefill s | decode s | grading s | core 0 busy | core 1 busy |"
    table = md[md.index(header) :].splitlines()
    assert table[2:6] == [
        "| evaluation at 0 | 30 |  |  |  |  |  | 25% | 100% |",
        "| step 1 | 40 | 30 | 5 | 1 | 20 | 4 | 50% | 100% |",
        "| step 2 | 60 | 50 | 5 | 1 | 20 | 4 | 75% | 100% |",
        "| evaluation at 2 | 35 |  |  |  |  |  |  |  |",
    ]
    # a run without profile values (tests' _run_dir) has no such table
    assert "Where the time goes" not in write_report(_run_dir(tmp_path / "plain")).read_text()
