"""`composer-jax rl` and `composer-jax eval` end to end: a run that stops after a step, resumes
from its checkpoint at the saved data position, and an evaluation of the checkpoint it wrote."""

from __future__ import annotations

import json

import pytest
from support.bwrap import needs_bwrap
from support.live_env import REPO

from composer_jax.cli import main as cli_main
from composer_jax.rl.cli import eval_main, rl_main

CONFIG = str(REPO / "tests" / "rl" / "fixtures" / "rl_pick.yaml")
pytestmark = needs_bwrap


# slow: 61 s; the resumed lineage is also tested by tests/rl/rollout/test_rollout_queue.py (resume_groups), the
# learner's resume end to end by tests/rl/test_async_resume.py (slow too)
@pytest.mark.slow
def test_rl_cli_stops_resumes_and_eval_reads_its_checkpoint(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    out = tmp_path / "run"
    assert rl_main(["--config", CONFIG, f"train.out_dir={out}", "--stop-after", "1"]) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert first["final_step"] == 1 and first["rollout/groups"] == 2.0 and first["dropped_stale_groups"] == 0
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["step"] == 0 and "eval/pass@1" in lines[0]  # the held-out evaluation at the start
    assert lines[1]["step"] == 1 and "mismatch_kl_k1" in lines[1] and "reward/total" in lines[1]
    # rl.max_staleness 0 (the default) is the synchronous learner: every token of the policy version trained
    assert lines[1]["version_lag_max"] == 0 and lines[1]["staleness/max"] == 0 and lines[1]["staleness/groups_0"] == 2
    assert lines[1]["rl/dropped_stale_groups"] == 0

    assert rl_main(["--config", CONFIG, f"train.out_dir={out}"]) == 0
    captured = capsys.readouterr().out
    assert "resumed from step 1" in captured and "at group 2" in captured
    assert json.loads(captured.strip().splitlines()[-1])["final_step"] == 2
    assert not list((out / "rollouts").glob("group_*"))  # every trained group's file went with its checkpoint
    # the resumed run's end evaluation is paired with the step-0 one the first call ran, rollout by rollout
    start, end = (json.loads((out / "eval_outcomes" / f"step_{s:06d}.json").read_text()) for s in (0, 2))
    assert set(start) == set(end) == {"pick-colour"} and len(start["pick-colour"]) == len(end["pick-colour"]) == 2
    last = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert last["step"] == 2 and sum(start["pick-colour"]) / 2 == lines[0]["eval/pass@1"]
    assert last["eval/paired_diff"] == pytest.approx((sum(end["pick-colour"]) - sum(start["pick-colour"])) / 2)
    assert last["eval/paired_tasks"] == 1 and last["eval/paired_pairs"] == 2

    ev = tmp_path / "eval"
    args = ["--tasks", "tests/rl/fixtures/tasks", "--checkpoint", str(out / "checkpoints"), "--samples", "2"]
    assert (
        eval_main([*args, "--out", str(ev), "--max-len", "192", "agent.max_turns=1", "agent.max_turn_tokens=16"]) == 0
    )
    report = json.loads((ev / "report.json").read_text())
    assert set(report["tasks"]) == {"pick-colour"} and report["tasks"]["pick-colour"]["samples"] == 2.0
    assert len((ev / "trajectories.jsonl").read_text().splitlines()) == 2


def test_cli_errors_name_the_bad_value(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert cli_main(["rl", "--config", CONFIG, "rl.group_size=1", f"train.out_dir={tmp_path}"]) == 2
    assert "rl.group_size=1: expected an integer >= 2" in capsys.readouterr().err
    args = ["--tasks", "tests/rl/fixtures/tasks", "--endpoint", "http://127.0.0.1:9/v1", "--out", str(tmp_path)]
    assert cli_main(["eval", *args, "--model", "m", "turns=3"]) == 2
    assert "eval takes agent.KEY=VALUE overrides only; got 'turns'" in capsys.readouterr().err
    assert cli_main(["eval", *args, "--model", "m", "--task", "nope"]) == 2
    assert "--task: task(s) ['nope'] are not runnable" in capsys.readouterr().err


def test_shipped_rl_config_loads_and_names_real_families(monkeypatch):
    """configs/rl/tiny_families.yaml is valid for the learner and names families the server has."""
    from composer_jax.config import load_config
    from composer_jax.env.tasks.families import FAMILIES
    from composer_jax.rl.learner import check_config

    monkeypatch.chdir(REPO)
    cfg = load_config("configs/rl/tiny_families.yaml")
    check_config(cfg)
    assert {t.removeprefix("gen/") for t in cfg.rl.tasks + cfg.rl.eval_tasks} <= set(FAMILIES)
    assert cfg.train.init_from == "runs/tiny/stage3/checkpoints" and cfg.agent.context_budget == 640
