"""`composer-jax demo` runs end to end on the fake mesh and its loss falls."""

import re

from composer_jax.cli import main as cli_main
from composer_jax.demo import main, rl_line


def test_demo_runs_and_learns(capsys):
    assert main(["--quick", "--steps", "16", "--seq", "32"]) == 0
    out = capsys.readouterr().out
    assert "parameters  total 250K" in out and "memory per device" in out
    nll = [float(x) for x in re.findall(r"next-token nll ([0-9.]+)", out)]
    assert len(nll) >= 3 and nll[-1] < nll[0] - 1.0, nll


def test_demo_bad_override_is_clear(capsys):
    assert cli_main(["demo", "--quick", "mesh.expert=3"]) == 2
    err = capsys.readouterr().err
    assert "mesh" in err and "8 devices" in err


def test_rl_summary_line_carries_the_paired_change():
    steps = {n: {"reward/total": 0.1 * n, "rollout/success": 0.2 * n} for n in (1, 2)}
    start = {"step": 0, "eval/pass@1": 0.25, "eval/best_of_k": 0.5, "eval/reward": 0.25}
    end = {"step": 2, "eval/pass@1": 0.375, "eval/best_of_k": 0.5, "eval/reward": 0.375}
    rl = {"steps": steps, "evals": [start, end], "time_s": 12.0, "eval_samples": 2}
    assert "paired" not in rl_line(rl)  # no paired values: the line is as before
    end.update({"eval/paired_diff": 0.125, "eval/paired_se": 0.0625, "eval/paired_z": 2.0})
    end.update({"eval/paired_tasks": 4.0, "eval/paired_pairs": 8.0})
    line = rl_line(rl)
    assert "held-out     pass@1 0.250 (step 0) -> 0.375 (step 2)" in line
    assert line.endswith("paired change +0.125 (se 0.062, z 2.00; 4 tasks, 8 pairs)")


def test_rl_summary_shows_the_trend_of_three_steps_or_more():
    # reward 0.1, 0.3, 0.2 at steps 1-3: slope 0.1 / 2 = 0.05; residuals -0.05, 0.1, -0.05: se sqrt(0.015 / 1 / 2)
    steps = {n: {"reward/total": r, "rollout/success": 0.5} for n, r in ((1, 0.1), (2, 0.3), (3, 0.2))}
    ev = {"step": 0, "eval/pass@1": 0.25, "eval/best_of_k": 0.5, "eval/reward": 0.25}
    line = rl_line({"steps": steps, "evals": [ev, ev], "time_s": 1.0, "eval_samples": 2})
    assert "reward slope +0.050 +- 0.087 /step (z 0.6, 3 steps); first quarter 0.100 -> last 0.200 (1 each)" in line
    assert "success slope +0.000 +- 0.000 /step (3 steps)" in line


def test_rl_summary_says_where_the_time_goes():
    steps = {n: {"reward/total": 0.1, "rollout/success": 0.5} for n in (1, 2)}
    ev = {"step": 0, "eval/pass@1": 0.25, "eval/best_of_k": 0.5, "eval/reward": 0.25}
    rl = {"steps": steps, "evals": [ev, ev], "time_s": 1.0, "eval_samples": 2}
    assert "where the time goes" not in rl_line(rl)  # no profile values: nothing said
    for n, wall in ((1, 10.0), (2, 20.0)):
        steps[n].update({"profile/wall_s": wall, "profile/sampler_decode_s": wall / 2, "profile/core0_busy": 0.5})
    ev2 = {**ev, "eval/profile/wall_s": 7.0}
    line = rl_line({**rl, "evals": [ev2, ev2]})
    assert "where the time goes, mean of 2 step(s): wall 15 s; sampler decode 7.5 s; cores busy 0 50%" in line
    assert line.endswith("2 evaluation(s): wall 7 s each on average")


def test_the_stages_run_where_the_demo_says():
    """Stage 3 on one device (its mesh all 1s), stages 1 and 2 on the fake 8-device mesh; the RL
    stage on two cores: two replicas pinned a core each, the trainer on both, one compile cache; on
    one core a single unpinned replica; overrides a caller gives replace the stage's own."""
    import json

    import jax

    from composer_jax.demo import STAGES, async_overrides, rl_stage_config, stage_devices

    for name, path in STAGES:
        cfg, devices = stage_devices(name, path, [])
        mesh = cfg.mesh.shape(len(devices))
        if name == "stage3_sft":
            assert devices == jax.devices()[:1] and set(mesh.values()) == {1}
        else:
            assert len(devices) == 8 and mesh["fsdp"] == 2 and mesh["expert"] == 2
    two = async_overrides(2, "/runs/x/rl")
    assert two == [
        "rl.max_staleness=1",
        "rl.local_samplers=2",
        "rl.sampler.slots=32",
        "rl.pin_cores=true",
        "rl.pin_trainer=false",
        f"rl.sampler.compile_cache={json.dumps('/runs/x/rl/compile_cache')}",
    ]
    one = async_overrides(1, "/runs/x/rl")
    assert "rl.local_samplers=1" in one and "rl.pin_cores=false" in one
    out = "/tmp/demo-out"
    cfg = rl_stage_config(out, f"{out}/stage3_sft/checkpoints", 1.0, lambda s: None, ["train.steps=3"])
    assert cfg.train.steps == 3 and cfg.rl.max_staleness == 1
