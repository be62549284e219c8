"""Environment servers for a run: the given URLs, or local `composer-jax env-server` processes.

With no URLs configured, a run starts its own servers (the embedded default) as child processes
on free ports of 127.0.0.1, with a fresh token, and stops them when it ends. They are separate
processes, as on a cluster: a server that dies costs its sessions only (the agent restarts them).
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import time
from pathlib import Path

import httpx


class EnvServerError(RuntimeError):
    pass


def stop_processes(procs: list[subprocess.Popen], grace_s: float = 10.0) -> None:
    """Terminate the running children (SIGTERM), SIGKILL those still alive after `grace_s`, wait
    for each (no zombies), and empty the list."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    procs.clear()


class LocalEnvServers:
    """`with LocalEnvServers(tasks_dir, count) as (urls, token):` - servers on 127.0.0.1."""

    def __init__(
        self,
        tasks_dir: str | os.PathLike,
        count: int = 1,
        *,
        token: str | None = None,
        extra_args: tuple[str, ...] = (),
    ):
        if count < 1:
            raise ValueError(f"count={count} local environment servers: give at least 1")
        if not Path(tasks_dir).is_dir():
            raise EnvServerError(f"tasks directory {str(tasks_dir)!r} does not exist or is not a directory")
        self.tasks_dir, self.count, self.extra = Path(tasks_dir), count, extra_args
        self.token = token or secrets.token_urlsafe(24)
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []

    def _start_one(self) -> tuple[subprocess.Popen, str]:
        env = dict(os.environ, COMPOSER_JAX_ENV_TOKEN=self.token)
        cmd = [sys.executable, "-m", "composer_jax.cli", "env-server", "--tasks", str(self.tasks_dir)]
        proc = subprocess.Popen(
            [*cmd, "--host", "127.0.0.1", "--port", "0", *self.extra],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        match = re.search(r"listening on (\S+)", line)
        if not match:
            proc.kill()
            raise EnvServerError(f"environment server did not start: {line!r} {proc.stderr.read()[-2000:]}")
        url = match.group(1)
        for _ in range(200):
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    return proc, url
            except httpx.HTTPError:
                time.sleep(0.05)
        proc.kill()
        raise EnvServerError(f"environment server at {url} never answered /health")

    def __enter__(self) -> tuple[list[str], str]:
        try:
            for _ in range(self.count):
                proc, url = self._start_one()
                self.procs.append(proc)
                self.urls.append(url)
        except BaseException:
            self.stop()
            raise
        return self.urls, self.token

    def stop(self) -> None:
        stop_processes(self.procs)

    def __exit__(self, *exc: object) -> None:
        self.stop()
