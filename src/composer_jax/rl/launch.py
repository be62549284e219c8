"""Sampler replicas for a run: K `composer-jax serve` child processes on one machine.

`LocalSamplers` is the sampler-side twin of `rl.envs.LocalEnvServers`: it starts `count` replicas of
`composer-jax serve` over one checkpoint, each a separate process (as samplers on separate
accelerators would be), optionally pinned to its own CPU core (`os.sched_setaffinity` in the child
before it starts), on free ports of 127.0.0.1, sharing one generated API key, each following the
run's weight-sync store (`--weights-from`), and waits until every replica answers /health. The
learner talks to them through `rl.remote_policy.RemoteTokenPolicy(url, key, ...)`.

Teardown leaves no process behind: `stop()` (also on an exception inside the `with` block or while
starting) terminates every replica, waits, and kills what is left; each child also asks the kernel
to send it SIGTERM when the launching process dies (Linux `PR_SET_PDEATHSIG`), so not even a killed
launcher orphans its replicas. (The kernel sends that signal when the *thread* that started the child
ends: create `LocalSamplers` on a thread that lives as long as the run, e.g. the main thread.)
Each replica's output goes to `log_dir/sampler-<i>.log`.
"""

from __future__ import annotations

import os
import re
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

from composer_jax.rl.envs import stop_processes

START_TIMEOUT_S = 300.0  # LocalSamplers' default bound on a replica's start
_LISTENING = re.compile(r"composer-jax serve: .* on (http://\S+?)/v1 ")


class SamplerLaunchError(RuntimeError):
    """A replica did not start (its log's tail is in the message) or an argument is out of range."""


# The child's first lines (Python, in the child: no preexec_fn, whose fork of a multithreaded JAX
# process is unsafe): die with the launcher, pin to the core, then run `composer-jax` with the rest.
_BOOTSTRAP = """
import ctypes, os, signal, sys
core, launcher, argv = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3:]
try:
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass
if os.getppid() != launcher:
    sys.exit("composer-jax sampler: the launching process is gone")
if core >= 0:
    os.sched_setaffinity(0, {core})
from composer_jax.cli import main
sys.exit(main(argv))
"""


class LocalSamplers:
    """`with LocalSamplers(checkpoint, count, weights_from=URL) as (urls, key):` - replicas on 127.0.0.1.

    cores: one CPU core per replica to pin it to (None: not pinned); the cores must be in this
    process's affinity set. extra_args: more `serve` arguments (e.g. ("--slots", "16", "--max-len",
    "4096")). start_timeout_s bounds each replica's start (JAX import, checkpoint read, and with
    `--warm-up` the compilation of its admission programs)."""

    def __init__(
        self,
        checkpoint: str | os.PathLike,
        count: int = 1,
        *,
        weights_from: str | None = None,
        poll_interval_s: float = 1.0,
        cores: Sequence[int] | None = None,
        api_key: str | None = None,
        extra_args: Sequence[str] = (),
        log_dir: str | os.PathLike | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
    ):
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise SamplerLaunchError(f"count={count!r} sampler replicas: give an int >= 1")
        if not Path(checkpoint).exists():
            raise SamplerLaunchError(f"checkpoint {str(checkpoint)!r} does not exist")
        if cores is not None:
            allowed = os.sched_getaffinity(0)
            if len(cores) != count or len(set(cores)) != count or not set(cores) <= allowed:
                raise SamplerLaunchError(
                    f"cores={list(cores)!r}: give {count} distinct cores out of this process's {sorted(allowed)}"
                )
        if not poll_interval_s > 0:
            raise SamplerLaunchError(f"poll_interval_s={poll_interval_s!r}; accepted: seconds > 0")
        if api_key is not None and len(api_key) < 16:
            raise SamplerLaunchError("api_key must be at least 16 characters")
        self.checkpoint, self.count, self.weights_from = Path(checkpoint), count, weights_from
        self.poll_interval_s, self.cores, self.extra = poll_interval_s, cores, tuple(extra_args)
        self.api_key = api_key or secrets.token_urlsafe(32)
        self.start_timeout_s = start_timeout_s
        self._tmp: tempfile.TemporaryDirectory | None = None
        if log_dir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="composer-jax-samplers-")
            log_dir = self._tmp.name
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: list[subprocess.Popen] = []
        self.urls: list[str] = []

    def _start(self, i: int) -> subprocess.Popen:
        core = self.cores[i] if self.cores is not None else -1
        cmd = [sys.executable, "-c", _BOOTSTRAP, str(core), str(os.getpid())]
        cmd += ["serve", "--checkpoint", str(self.checkpoint)]
        cmd += ["--host", "127.0.0.1", "--port", "0"]
        if self.weights_from is not None:
            cmd += ["--weights-from", self.weights_from, "--poll-interval", str(self.poll_interval_s)]
        log = open(self.log_dir / f"sampler-{i}.log", "w")  # noqa: SIM115 - the child writes it
        try:
            return subprocess.Popen(
                [*cmd, *self.extra],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=dict(os.environ, COMPOSER_JAX_API_KEY=self.api_key, PYTHONUNBUFFERED="1"),
            )
        finally:
            log.close()

    def _wait_ready(self, i: int, proc: subprocess.Popen) -> str:
        path, deadline = self.log_dir / f"sampler-{i}.log", time.monotonic() + self.start_timeout_s
        url = None
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                break
            if url is None and (m := _LISTENING.search(path.read_text(errors="replace"))):
                url = m.group(1)
            if url is not None:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        return url
                except httpx.HTTPError:
                    pass
            time.sleep(0.1)
        tail = path.read_text(errors="replace")[-3000:]
        why = (
            f"exited with status {proc.returncode}"
            if proc.poll() is not None
            else f"did not answer /health within start_timeout_s={self.start_timeout_s:g} s"
        )
        raise SamplerLaunchError(f"sampler replica {i} ({self.checkpoint}) {why}; its log ({path}):\n{tail}")

    def __enter__(self) -> tuple[list[str], str]:
        try:
            for i in range(self.count):  # all start together; each is then waited for
                self.procs.append(self._start(i))
            for i, proc in enumerate(self.procs):
                self.urls.append(self._wait_ready(i, proc))
        except BaseException:
            self.stop()
            raise
        return self.urls, self.api_key

    def stop(self) -> None:
        """Terminate every replica (SIGTERM, then SIGKILL after 10 s) and wait for each."""
        stop_processes(self.procs)
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __exit__(self, *exc: object) -> None:
        self.stop()
