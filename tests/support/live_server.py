"""A live `composer-jax env-server` subprocess for the environment-server tests, and what they share
about it: the fixture tasks, the marks of a sandbox test (support/bwrap.py), a child environment
with the sources on its path, one tool call over HTTP. The pytest fixtures built on it are in tests/env/conftest.py."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from support.bwrap import needs_bwrap

FIXTURE_TASKS = Path(__file__).resolve().parents[1] / "env" / "fixtures" / "tasks"
SRC = Path(__file__).resolve().parents[2] / "src"
# a sandbox test: skipped or failed without bubblewrap (support/bwrap.py)
requires_bwrap = [pytest.mark.sandbox, needs_bwrap]


def env_with_src() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(SRC) + os.pathsep + env.get("PYTHONPATH", "")
    return env


class LiveServer:
    def __init__(self, *extra: str, tasks: Path = FIXTURE_TASKS, python: str = sys.executable):
        self.proc = subprocess.Popen(
            [python, "-m", "composer_jax.cli", "env-server", "--tasks", str(tasks), "--port", "0", *extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env_with_src(),
        )
        assert self.proc.stdout is not None and self.proc.stderr is not None  # both are PIPEs
        line = self.proc.stdout.readline()
        match = re.search(r"listening on (\S+) ", line)
        if not match:
            self.proc.kill()
            raise RuntimeError(f"server did not start: {line!r} {self.proc.stderr.read()[-2000:]}")
        # the server prints the token only when it generated it; a given one is the caller's
        shown = re.search(r" token=(\S+)", line)
        self.url = match.group(1)
        self.token = shown.group(1) if shown else extra[extra.index("--token") + 1]
        self.headers = {"Authorization": f"Bearer {self.token}"}
        for _ in range(100):
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.05)

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, headers=self.headers, timeout=60)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def call(http, sid, name, **arguments):
    """One tool call; returns its result entry."""
    r = http.post(f"/sessions/{sid}/tools", json={"calls": [{"name": name, "arguments": arguments}]})
    assert r.status_code == 200, r.text
    return r.json()["results"][0]
