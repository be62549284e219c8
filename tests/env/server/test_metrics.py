"""The environment server's metrics below the HTTP layer: what the sandbox backends count (spawn
and setup failures, kills by a limit, commands running) and how `EnvMetrics` exposes state it reads
at scrape time. Read back with prometheus_client's own parser (tests/support/metrics_scrape.py)."""

from __future__ import annotations

import asyncio

import pytest
from support.bwrap import needs_bwrap
from support.metrics_scrape import parse

from composer_jax.env.sandbox.runner import BubblewrapSandbox, Limits, LocalProcessSandbox, Mount, SandboxStats
from composer_jax.env.server.metrics import EnvMetrics


def test_local_backend_counts_spawn_failures_kills_and_running(tmp_path):
    sandbox = LocalProcessSandbox()
    lease = sandbox.lease("s")
    (tmp_path / "app").mkdir()
    app = Mount(tmp_path / "app", "/app", True)

    async def go():
        with pytest.raises(FileNotFoundError):  # the cwd's host directory is missing: nothing starts
            await lease.run(["true"], mounts=[Mount(tmp_path / "gone", "/app")], limits=Limits())
        slow = asyncio.ensure_future(lease.run(["sleep", "0.5"], mounts=[app], limits=Limits()))
        await asyncio.sleep(0.2)
        running = sandbox.stats.running
        await slow
        timed = await lease.run(["sleep", "5"], mounts=[app], limits=Limits(wall_seconds=0.2))
        noisy = await lease.run(["yes"], mounts=[app], limits=Limits(output_bytes=1024))
        fake = await lease.run(["sh", "-c", "echo 'bwrap: no' >&2; exit 1"], mounts=[app], limits=Limits())
        return running, timed, noisy, fake

    running, timed, noisy, fake = asyncio.run(go())
    assert running == 1 and timed.timed_out and noisy.truncated and fake.exit_code == 1
    assert sandbox.stats == SandboxStats(
        started=5, running=0, failed={"spawn": 1}, killed={"timeout": 1, "output": 1}
    )  # no bwrap here: its message from a command is the command's own failure


@pytest.mark.sandbox
@needs_bwrap
def test_bubblewrap_setup_failure_is_the_sandbox_s(tmp_path):
    sandbox = BubblewrapSandbox(use_cgroups=False)
    lease = sandbox.lease("s")
    (tmp_path / "app").mkdir()

    async def go():
        try:
            ok = await lease.run(["true"], mounts=[Mount(tmp_path / "app", "/app", True)], limits=Limits())
            # bwrap cannot bind a source that does not exist: it refuses before the command starts
            bad = await lease.run(["true"], mounts=[Mount(tmp_path / "gone", "/data")], cwd="/", limits=Limits())
            return ok, bad
        finally:
            await lease.close()

    ok, bad = asyncio.run(go())
    assert ok.exit_code == 0 and bad.exit_code == 1 and bad.stderr.startswith("bwrap: "), bad
    assert sandbox.stats == SandboxStats(started=2, running=0, failed={"setup": 1}, killed={})


class _Cache:
    builds = {"ok": 2, "failed": 1}

    def counts(self):
        return {"built": 3, "failed": 1}


def test_state_is_read_at_scrape_time():
    metrics, stats, open_sessions = EnvMetrics(), SandboxStats(), [0]
    metrics.watch(lambda: open_sessions[0], stats, lambda: None)
    first = parse(metrics.render().decode())
    assert first("cj_env_sessions_active") == 0 and first("cj_env_sandboxes_created_total") == 0
    assert "cj_env_environments" in first.types and not first.labels.get("cj_env_environments")  # no cache
    open_sessions[0], stats.started, stats.running = 4, 7, 2
    stats.count(stats.failed, "setup")
    metrics.watch(lambda: open_sessions[0], stats, lambda: _Cache())  # watching again replaces, not adds
    got = parse(metrics.render().decode())
    assert got("cj_env_sessions_active") == 4 and got("cj_env_sandboxes_running") == 2
    assert got("cj_env_sandboxes_created_total") == 7 and got("cj_env_sandboxes_failed_total", reason="setup") == 1
    assert got("cj_env_environments", state="built") == 3 and got("cj_env_environments", state="failed") == 1
    assert got("cj_env_environment_builds_total", outcome="ok") == 2
    assert got.types["cj_env_sandboxes_killed"] == "counter" and got.types["cj_env_sandboxes_running"] == "gauge"
    # two servers in one process: separate registries, no duplicate-name error, no shared counts
    other = EnvMetrics()
    other.sessions_created.inc()
    assert parse(metrics.render().decode())("cj_env_sessions_created_total") == 0
    assert parse(other.render().decode())("cj_env_sessions_created_total") == 1
