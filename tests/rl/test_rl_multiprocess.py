"""`composer-jax rl` as a real two-process JAX job on one machine (CPU collectives over gloo).

Two trainer processes (2 CPU devices each, one 4-device mesh) against one process with 4 devices on
the same config: process 0 runs the rollout side (a local environment server, one `serve` replica
following the weight store) and broadcasts each step's groups; both train. Synchronous
(`rl.max_staleness: 0`) with fixed seeds the rollouts are the replica's, so both runs must train the
same group ids per step with the same per-step losses (float32 reduction order aside) and the same
held-out evaluations; one metrics record per step; both processes report the same numbers. A
two-process run stopped after step 2 and restarted trains every group id exactly once across the two.
Also: an asynchronous two-process run keeps the staleness contract, and an error in process 0's step
stops both processes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import pytest
from support.bwrap import needs_bwrap
from support.learnable import sft_params
from support.live_env import REPO
from support.multiprocess_launch import free_port, run_processes

from composer_jax.checkpoint.manager import TrainCheckpointer
from composer_jax.config import CheckpointConfig, load_config, to_dict
from composer_jax.sharding import ShardingRules, make_mesh
from composer_jax.train.loop import run_tokenizer
from composer_jax.train.state import init_train_state

pytestmark = [
    pytest.mark.slow,
    needs_bwrap,
]

STEPS = 3
SFT_STEPS = 150
RUN = (
    "agent.max_turn_tokens=40",  # room for the tool call the starting policy makes
    "rl.reward.length_penalty.weight=0.05",  # and lengths differ: fewer groups of equal rewards
    f"train.steps={STEPS}",
    "mesh.data=2",
    "mesh.fsdp=2",
    "mesh.expert=1",
    "rl.local_samplers=1",
    "rl.sampler.slots=8",
    "rl.eval_every=2",
    "checkpoint.save_every=1",
)


CONFIG = "tests/rl/fixtures/rl_pick.yaml"


def starting_checkpoint(directory: Path) -> Path:
    """The fixture's tiny model fine-tuned a little on the task's two answers (tests/support/learnable.py),
    so that rollouts differ in outcome and length and the RL loss is not zero; saved for init_from."""
    cfg = load_config(CONFIG, ["train.optimizer.lr=0.02", "train.optimizer.warmup_steps=5", "mesh.fsdp=-1"])
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])  # a tiny model: one device is fastest
    params, _ = sft_params(cfg, run_tokenizer(cfg), steps=SFT_STEPS, mesh=mesh)
    with TrainCheckpointer(CheckpointConfig(directory=str(directory))) as ckpt:
        ckpt.save(0, init_train_state(cfg, mesh, ShardingRules.create(), params), config=to_dict(cfg), force=True)
    return directory


def rl_command(out_dir: Path, extra: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "composer_jax.cli",
        "rl",
        "--config",
        CONFIG,
        f"train.out_dir={out_dir}",
        *RUN,
        *extra,
    ]


def two_processes(out_dir: Path, extra: list[str], returncodes: list[int] | None = None) -> list[str]:
    port = free_port()
    return run_processes(
        [
            rl_command(out_dir, [*extra, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"])
            + ["--process-id", str(i), "--cpu-devices", "2"]
            for i in range(2)
        ],
        timeout=1200,
        returncodes=returncodes,
    )


def final_json(out: str) -> dict:
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


def records(out_dir: Path) -> tuple[dict[int, dict], dict[int, dict]]:
    """(step records with a loss, evaluation records) of metrics.jsonl, each step once."""
    lines = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if "loss" in r]
    evals = [r for r in lines if "eval/pass@1" in r]
    for kind in (train, evals):
        steps = [r["step"] for r in kind]
        assert len(steps) == len(set(steps)), f"a step was logged twice: {steps}"
    return {r["step"]: r for r in train}, {r["step"]: r for r in evals}


def same_numbers(a: dict, b: dict) -> dict:
    """`a` without what depends on time (the idle fraction)."""
    assert a.keys() == b.keys()
    return {k: v for k, v in a.items() if k != "trainer_idle_fraction"}


def test_two_process_rl_trains_and_resumes_as_one(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    init = [f"train.init_from={starting_checkpoint(tmp_path / 'sft')}", "rl.max_staleness=0"]
    one = tmp_path / "one"
    (single,) = run_processes([rl_command(one, [*init, "--cpu-devices", "4"])], timeout=1200)
    ref, ref_evals = records(one)
    assert sorted(ref) == [1, 2, 3] and sorted(ref_evals) == [0, 2, 3]
    ref_groups = final_json(single)["trained_groups"]
    assert ref_groups == {"1": [0, 1], "2": [2, 3], "3": [4, 5]}

    two = tmp_path / "two"
    first = two_processes(two, [*init, "--stop-after", "2"])
    a, b = (final_json(o) for o in first)
    assert same_numbers(a, b) == same_numbers(b, a) and a["final_step"] == 2
    assert 2 in [int(p.name) for p in (two / "checkpoints").iterdir() if p.name.isdigit()]
    second = two_processes(two, init)
    assert "resumed from step 2" in second[0] and "resumed from step 2" not in second[1]  # process 0 prints
    a2, b2 = (final_json(o) for o in second)
    assert same_numbers(a2, b2) == same_numbers(b2, a2) and a2["final_step"] == STEPS

    # every group id trained exactly once across the two runs, at the single process's steps
    trained = {**a["trained_groups"], **a2["trained_groups"]}
    assert trained == ref_groups
    ids = [i for g in trained.values() for i in g]
    assert sorted(ids) == list(range(2 * STEPS))
    assert not list((two / "rollouts").glob("*"))  # every persisted group trained and removed

    got, got_evals = records(two)
    assert sorted(got) == [1, 2, 3] and sorted(got_evals) == [0, 2, 3]  # process 0 alone writes
    assert all(r["grad_norm"] > 0 for r in ref.values())  # the losses compared are of real gradients
    for step, r in ref.items():
        for key in ("loss", "reward/total", "rollout/success", "rollout/generated_tokens"):
            assert got[step][key] == pytest.approx(r[key], rel=2e-5, abs=1e-6), (step, key, got[step], r)
        assert got[step]["staleness/max"] == 0 and got[step]["version_lag_max"] == 0
        # each process receives only its rows: process 1's devices hold rows 4-7 of the 8 (data 2 x
        # fsdp 2 over 2 processes), half the batch's bytes; the whole batch is 8 rows x 192 tokens
        # x (6 int32/float32 arrays + routing of 1 MoE layer x k=2 int32) = 49,152 bytes
        assert got[step]["batch/bytes"] == r["batch/bytes"] == 8 * 192 * (6 * 4 + 1 * 2 * 4)
        assert got[step]["batch/received_bytes_max"] == got[step]["batch/bytes"] / 2
    for step, r in ref_evals.items():
        assert got_evals[step]["eval/pass@1"] == r["eval/pass@1"], (step, got_evals, ref_evals)


def test_two_process_asynchronous_rl(tmp_path, monkeypatch) -> None:
    """`rl.max_staleness: 1`: process 0's queue keeps sampling while both processes train; which
    groups a step takes depends on timing, so the check is the contract, not equality with one
    process: each group id trained once, no trained token over one version old, one metrics record
    per step, both processes agreeing on every step's groups and values."""
    monkeypatch.chdir(REPO)
    out = tmp_path / "async"
    outs = two_processes(out, ["rl.max_staleness=1", "rl.eval_tasks=[]"])
    a, b = (final_json(o) for o in outs)
    assert same_numbers(a, b) == same_numbers(b, a) and a["final_step"] == STEPS
    ids = [i for g in a["trained_groups"].values() for i in g]
    assert len(ids) == len(set(ids)) == 2 * STEPS - a["dropped_stale_groups"]
    got, _ = records(out)
    assert sorted(got) == [1, 2, 3]
    for step, r in got.items():
        assert r["staleness/max"] <= 1 and r["version_lag_max"] <= 1, (step, r)


def test_an_error_on_process_0_stops_both(tmp_path, monkeypatch) -> None:
    """Process 0's step fails (the environment server rejects the task): it hands the error to
    process 1, which stops with it instead of waiting in the step's collectives."""
    monkeypatch.chdir(REPO)
    outs = two_processes(tmp_path / "bad", ["rl.tasks=[no-such-task]", "rl.eval_tasks=[]"], returncodes=[1, 1])
    assert "unknown task_id 'no-such-task'" in outs[0]
    assert "step 0: process 0 stopped the run: RequestRejected" in outs[1]
    assert "unknown task_id 'no-such-task'" in outs[1]


def test_a_setup_error_on_process_0_stops_both(tmp_path, monkeypatch) -> None:
    """Process 0 fails before step 1, outside any step (its local environment servers cannot start:
    no such tasks directory): process 1, which only trains, gets the error at the setup's end
    instead of waiting for process 0 in the first step's collectives."""
    monkeypatch.chdir(REPO)
    outs = two_processes(tmp_path / "setup", ["rl.tasks_dir=no/such/tasks"], returncodes=[2, 1])
    assert "composer-jax rl: error: tasks directory 'no/such/tasks' does not exist" in outs[0]
    assert (
        "composer-jax rl: starting the rollout side: process 0 stopped the run: EnvServerError: "
        "tasks directory 'no/such/tasks' does not exist"
    ) in outs[1]
