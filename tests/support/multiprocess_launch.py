"""Launch helpers for the tests that start real JAX processes (`from support.multiprocess_launch import ...`)."""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


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
