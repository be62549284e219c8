"""A real environment server in a subprocess for the RL tests (the env tests' fixture, not shared:
tests/env's conftest is imported by name there)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[2]
ENV_FIXTURE_TASKS = REPO / "tests" / "env" / "fixtures" / "tasks"
HAVE_BWRAP = shutil.which("bwrap") is not None
needs_bwrap = pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap (bwrap) is not installed; `make system-deps`")


class EnvServer:
    def __init__(self, tasks: Path, *extra: str):
        env = dict(os.environ)
        env["PYTHONPATH"] = str(REPO / "src") + os.pathsep + env.get("PYTHONPATH", "")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "composer_jax.cli", "env-server", "--tasks", str(tasks), "--port", "0", *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert self.proc.stdout is not None and self.proc.stderr is not None
        line = self.proc.stdout.readline()
        match = re.search(r"listening on (\S+) .*token=(\S+)", line)
        if not match:
            self.proc.kill()
            raise RuntimeError(f"server did not start: {line!r} {self.proc.stderr.read()[-2000:]}")
        self.url, self.token = match.group(1), match.group(2)
        for _ in range(200):
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
