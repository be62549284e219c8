"""Real two-process JAX training on one machine (CPU collectives over gloo), against one process.

Two `composer-jax pretrain` processes (2 CPU devices each, one 4-device mesh) must compute what one
process with 4 devices computes: the same per-step losses (float32 reduction order aside), the same
held-out perplexity, one metrics record per step, the checkpoints; a two-process run stopped after
step 2 and restarted continues with the single process's losses (the data position of both hosts
is in the checkpoint). `data.shards=2` in both runs makes the global batch independent of the host
count (data/shards.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from support.multiprocess_launch import FOUR_DEVICES, REPO, free_port, run_processes, stage_args


def _pretrain(out_dir: Path, data_dir: Path, extra: list[str], layout: tuple[str, ...] = FOUR_DEVICES) -> list[str]:
    return [sys.executable, "-m", "composer_jax.cli", "pretrain", *stage_args(out_dir, data_dir, layout), *extra]


def two_processes(
    out_dir: Path, data_dir: Path, extra: tuple[str, ...] = (), devices: int = 2, layout: tuple[str, ...] = FOUR_DEVICES
) -> list[str]:
    port = free_port()
    return run_processes(
        [
            _pretrain(
                out_dir,
                data_dir,
                [*extra, "--coordinator", f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i)]
                + ["--cpu-devices", str(devices)],
                layout,
            )
            for i in range(2)
        ]
    )


def step_losses(out_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r["step"] for r in records if "loss" in r]
    assert len(steps) == len(set(steps)), f"a step was logged twice: {steps}"
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def final_json(out: str) -> dict:
    return json.loads([line for line in out.splitlines() if line.startswith("{")][-1])


@pytest.fixture
def small_corpus(tmp_path) -> Path:
    d = tmp_path / "corpus"
    d.mkdir()
    for f in sorted((REPO / "src" / "composer_jax" / "train").glob("*.py")):
        (d / f.name).write_text(f.read_text())
    return d


@pytest.mark.slow
def test_two_processes_train_and_resume_as_one(tmp_path, small_corpus):
    one = tmp_path / "one"
    (single,) = run_processes([_pretrain(one, small_corpus, ["--cpu-devices", "4"])])
    ref = step_losses(one)
    assert sorted(ref) == [1, 2, 3, 4]

    two = tmp_path / "two"
    outs = two_processes(two, small_corpus, ("--stop-after", "2"))
    assert [final_json(o)["steps"] for o in outs] == [2, 2]
    assert sorted(int(p.name) for p in (two / "checkpoints").iterdir() if p.name.isdigit()) == [2]
    # the checkpoint holds both hosts' data positions
    data_state = json.loads((two / "checkpoints" / "2" / "data_state" / "metadata").read_text())
    assert data_state["shard_count"] == 2 and sorted(data_state["shards"]) == ["0", "1"]

    outs = two_processes(two, small_corpus)
    assert "resumed from step 2" in outs[0] and "resumed from step 2" not in outs[1]  # process 0 prints
    got = step_losses(two)
    assert sorted(got) == [1, 2, 3, 4]  # process 0 alone writes metrics, each step once
    for step in ref:
        assert got[step] == pytest.approx(ref[step], rel=2e-6), (step, got, ref)
    finals = [final_json(o) for o in outs]
    assert finals[0] == finals[1]  # both processes computed the same global numbers
    assert finals[0]["eval"]["eval/perplexity"] == pytest.approx(final_json(single)["eval"]["eval/perplexity"], 1e-5)
    assert sorted(int(p.name) for p in (two / "checkpoints").iterdir() if p.name.isdigit()) == [2, 4]


@pytest.mark.slow
def test_two_processes_with_one_data_shard_each(tmp_path, small_corpus):
    """The default `data.shards: 0` (one shard per process) on the stage config's 8-device mesh
    (data 2 x fsdp 2 x expert 2, 4 devices per process): both processes agree, checkpoints land."""
    layout = ("mesh.data=2", "mesh.fsdp=2", "mesh.expert=2", "data.shards=0", "train.batch_size=8")
    outs = two_processes(tmp_path, small_corpus, devices=4, layout=layout)
    finals = [final_json(o) for o in outs]
    assert finals[0] == finals[1] and finals[0]["steps"] == 4
    assert sorted(step_losses(tmp_path)) == [1, 2, 3, 4]
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [2, 4]
    data_state = json.loads((tmp_path / "checkpoints" / "4" / "data_state" / "metadata").read_text())
    assert data_state["shard_count"] == 2 and sorted(data_state["shards"]) == ["0", "1"]
