"""`sandbox.parent_guard`: a sandboxed command dies with the server that started it, and one whose
server is gone before it starts never runs (tests/runtime/test_supervisor.py kills a real server)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

from support.procs import cmdline, gone

from composer_jax.env.sandbox.runner import parent_guard


def test_a_guarded_command_runs_under_its_parent():
    out = subprocess.run([*parent_guard(), "echo", "started"], capture_output=True, text=True, timeout=30)
    assert (out.returncode, out.stdout) == (0, "started\n")


def test_a_command_whose_parent_is_not_the_guards_never_starts():
    # the guard names this process; a shell in between is another parent (as init is for an orphan)
    out = subprocess.run(
        ["/bin/sh", "-c", '"$@"; echo "status $?"', "sh", *parent_guard(), "echo", "started"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert out.stdout == "status 125\n"


def test_a_guarded_command_is_killed_when_its_parent_is():
    script = textwrap.dedent(
        """
        import subprocess, sys, time
        from composer_jax.env.sandbox.runner import parent_guard
        child = subprocess.Popen([*parent_guard(), "sleep", "60"])
        print(child.pid, flush=True)
        time.sleep(60)
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    pid = int(parent.stdout.readline())
    deadline = time.monotonic() + 30
    while not cmdline(pid).startswith("sleep") and time.monotonic() < deadline:
        time.sleep(0.02)  # past the guard (whose argv names the sleep too): the sleep itself runs
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(10)
    deadline = time.monotonic() + 10
    while not gone(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    try:
        assert gone(pid), "the command outlived its parent"
    finally:
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)
