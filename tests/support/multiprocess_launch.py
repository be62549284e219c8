"""Launch helpers for the tests that start real JAX processes (`from support.multiprocess_launch import ...`)."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


FOUR_DEVICES = ("mesh.data=2", "mesh.fsdp=2", "mesh.expert=1", "data.shards=2", "train.batch_size=4")


def stage_args(out_dir: Path, data_dir: Path, layout: tuple[str, ...] = FOUR_DEVICES) -> list[str]:
    """`composer-jax pretrain`'s arguments (after the subcommand) for the multi-process tests: the
    tiny stage 1 for 4 steps of 64 tokens on `data_dir`, evaluated and checkpointed every 2 steps,
    on the mesh `layout` gives. Half the documents held out: the corpus is a copy of
    src/composer_jax/train/ (11 files), whose hash split at 0.2 came out empty."""
    return [
        "--config",
        "configs/pretrain/tiny_stage1.yaml",
        "train.steps=4",
        "train.eval_every=2",
        "train.log_every=1",
        "train.eval_batches=1",
        "train.seq_len=64",
        "train.tensorboard=false",
        f"train.out_dir={out_dir}",
        "checkpoint.save_every=2",
        *layout,
        f"data.sources=[{{type: directory, path: {data_dir}, eval_fraction: 0.5}}]",
    ]


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (for `jax.distributed`'s coordinator)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_processes(cmds: list[list[str]], timeout: float = 900, *, returncodes: list[int] | None = None) -> list[str]:
    """Start every command at once from the repository root, wait for all and return their outputs;
    kill the rest if one fails or time runs out (none is left running whatever happens). Every
    command must exit 0, or with `returncodes` those codes."""
    env = {**os.environ, "XLA_FLAGS": "", "TF_CPP_MIN_LOG_LEVEL": "2", "PYTHONPATH": f"{REPO / 'src'}:{REPO}"}
    procs = [
        subprocess.Popen(c, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for c in cmds
    ]
    try:
        outs = [p.communicate(timeout=timeout)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out, want in zip(procs, outs, returncodes or [0] * len(procs)):
        assert p.returncode == want, out[-3000:]
    return outs
