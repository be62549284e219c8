"""A real two-process JAX run on one machine (CPU collectives over gloo), through the CLI."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_process_pretrain_agrees_and_checkpoints(tmp_path):
    port = _free_port()
    env = {**os.environ, "XLA_FLAGS": "", "TF_CPP_MIN_LOG_LEVEL": "2"}
    cmd = lambda i: [
        sys.executable,
        "-m",
        "composer_jax.cli",
        "pretrain",
        "--config",
        "configs/pretrain/tiny_stage1.yaml",
        "--coordinator",
        f"127.0.0.1:{port}",
        "--num-processes",
        "2",
        "--process-id",
        str(i),
        "--cpu-devices",
        "4",
        "train.steps=4",
        "train.eval_every=2",
        "train.log_every=1",
        "train.eval_batches=1",
        "train.seq_len=64",
        "train.tensorboard=false",
        f"train.out_dir={tmp_path}",
        "checkpoint.save_every=2",
    ]
    procs = [
        subprocess.Popen(cmd(i), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for i in range(2)
    ]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-3000:]
    finals = [json.loads([line for line in out.splitlines() if line.startswith("{")][-1]) for out in outs]
    # both processes computed the same global step: the same loss and held-out perplexity
    assert finals[0]["final_loss"] == finals[1]["final_loss"]
    assert finals[0]["eval"]["eval/perplexity"] == finals[1]["eval"]["eval/perplexity"]
    assert sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit()) == [2, 4]
