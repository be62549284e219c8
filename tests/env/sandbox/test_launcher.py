"""How a lease launches bubblewrap: nothing of the server's environment reaches a session, and
`_UidPool.sweep_orphans` ends what a server killed mid-setup left (tests/runtime/test_supervisor.py
kills a real one): the processes of a session uid that no live server holds, and the bwraps marked
with it; a held uid's are left alone."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time

import pytest
from support.bwrap import needs_bwrap
from support.procs import gone

from composer_jax.env.sandbox import runner
from composer_jax.env.sandbox.runner import BubblewrapSandbox, Limits, Mount, _UidPool

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="runs processes as session uids (root only)")


@needs_bwrap
def test_the_servers_environment_never_reaches_a_session(monkeypatch, tmp_path):
    monkeypatch.setenv("COMPOSER_JAX_TEST_SECRET", "hunter2")  # a credential the server holds
    sandbox = BubblewrapSandbox()

    async def run() -> str:
        lease = sandbox.lease("env")
        try:
            result = await lease.run(["env"], mounts=[Mount(tmp_path, "/app")], limits=Limits(), env={"MINE": "1"})
        finally:
            await lease.close()
        assert result.exit_code == 0, result
        return result.stdout

    seen = dict(line.split("=", 1) for line in asyncio.run(run()).splitlines())
    assert "COMPOSER_JAX_TEST_SECRET" not in seen and runner.SANDBOX_UID_VAR not in seen
    assert seen["MINE"] == "1" and seen["HOME"] == "/tmp" and seen["PATH"] == sandbox.path_env


def _run_as(uid: int) -> subprocess.Popen:
    """`sleep 300` as `uid`, returned once it runs as that uid (setpriv starts as root)."""
    proc = subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "sleep", "300"])
    deadline = time.monotonic() + 30
    while _uid_of(proc.pid) != uid and time.monotonic() < deadline:
        time.sleep(0.01)
    return proc


def _uid_of(pid: int) -> int | None:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Uid:"))


@as_root
def test_a_free_uids_processes_are_ended_and_a_held_uids_are_left_alone():
    server, other = _UidPool(), _UidPool()  # two servers on one host
    held = server.take()
    free = server.take()
    server.give(free)  # its server closed the session without ending this process: an orphan
    procs = {held: _run_as(held), free: _run_as(free)}
    try:
        swept = other.sweep_orphans()
        assert free in swept and held not in swept
        assert procs[free].wait(10) == -9
        assert procs[held].poll() is None and not gone(procs[held].pid)
        assert other.take() != held  # the sweep left the held uid's lock where it was
    finally:
        for p in procs.values():
            p.kill()
            p.wait(10)
        server.give(held)


@as_root
def test_a_pool_never_sweeps_the_uids_it_holds_itself():
    pool = _UidPool()
    uid = pool.take()
    proc = _run_as(uid)
    try:
        assert uid not in pool.sweep_orphans()
        assert proc.poll() is None
    finally:
        proc.kill()
        proc.wait(10)
        pool.give(uid)


SPAWNER = """
import asyncio, sys, tempfile, pathlib
from composer_jax.env.sandbox.runner import BubblewrapSandbox, Limits, Mount

async def main():
    sandbox = BubblewrapSandbox()
    app = pathlib.Path(tempfile.mkdtemp())
    leases, runs = [], []
    while True:  # sandboxes back to back, until this process is SIGKILLed
        lease = sandbox.lease(f"s{len(leases)}")
        leases.append(lease)
        runs.append(asyncio.ensure_future(lease.run(["sleep", "300"], mounts=[Mount(app, "/app")], limits=Limits())))
        await asyncio.sleep(0)  # the spawn
        print(lease.uid, flush=True)

asyncio.run(main())
"""


@as_root
@needs_bwrap
def test_sandboxes_a_killed_server_left_at_every_stage_of_their_setup_are_swept():
    # bubblewrap's PID 1 arms its death signal only after its setup: a server SIGKILLed while
    # sandboxes are starting leaves some running `sleep`, some waiting forever as root (bwrap
    # 0.8). A round leaves one about every other time: up to five rounds, until one does.
    uids: list[int] = []
    for _ in range(5):
        spawner = subprocess.Popen([sys.executable, "-c", SPAWNER], stdout=subprocess.PIPE, text=True)
        assert spawner.stdout is not None
        uids += [int(spawner.stdout.readline()) for _ in range(30)]
        spawner.kill()
        spawner.wait(10)
        time.sleep(0.5)  # what survived finishes its setup, or blocks in it
        if _left(uids):
            break
    _UidPool().sweep_orphans()
    deadline = time.monotonic() + 10
    while (left := _left(uids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, left


def _left(uids: list[int]) -> dict[int, list[int]]:
    """Live processes running for `uids` (as them, or bwraps marked with them)."""
    found = runner._sandbox_processes()
    return {uid: live for uid in uids if (live := [p for p in found.get(uid, []) if not gone(p)])}
