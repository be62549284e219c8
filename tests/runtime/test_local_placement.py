"""rl/processes.py: the one supervising launcher, with real `composer-jax env-server` children (no JAX,
up in about a second): the ready line, restarts on the same URL, giving up, the bootstrap's death
signal (no child or sandboxed tool process outlives a SIGKILLed launcher), bad arguments."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest
from support.bwrap import HAVE_BWRAP, needs_bwrap
from support.live_env import ENV_FIXTURE_TASKS
from support.procs import cmdline, descendants, gone

from composer_jax.rl.rollout.env_servers import EnvServerError, LocalEnvServers
from composer_jax.runtime.local import Launcher
from composer_jax.runtime.placement import LaunchError, RestartPolicy, ServiceSpec, parse_ready_line, ready_line

TOKEN = "rl-processes-test-token-0123456789"
# without bubblewrap the server runs its tools as plain processes, only when told to
SANDBOX_ARGS: tuple[str, ...] = () if HAVE_BWRAP else ("--unsafe-no-sandbox",)
FAST = RestartPolicy(backoff_s=0.05, max_backoff_s=0.2)


def _until(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def test_ready_line_is_parsed():
    assert parse_ready_line(ready_line("http://127.0.0.1:8000", 42)) == ("http://127.0.0.1:8000", 42)
    assert parse_ready_line('  {"event": "ready", "url": "http://[::1]:9/", "pid": 7}\n') == ("http://[::1]:9", 7)
    for other in [
        "composer-jax env-server listening on http://127.0.0.1:1 tasks=4 sandbox=bubblewrap token=x",
        "{not json",
        '{"event": "stopped", "url": "http://127.0.0.1:1", "pid": 7}',
        '{"event": "ready", "url": "127.0.0.1:1", "pid": 7}',
        '{"event": "ready", "url": "http://127.0.0.1:1", "pid": "7"}',
        '{"event": "ready", "url": "http://127.0.0.1:1", "pid": true}',
        '["ready"]',
    ]:
        assert parse_ready_line(other) is None, other


def test_killed_server_is_reaped_and_restarted_on_its_url(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="composer_jax.runtime.local")
    core = min(os.sched_getaffinity(0))
    servers = LocalEnvServers(
        ENV_FIXTURE_TASKS, token=TOKEN, extra_args=SANDBOX_ARGS, cores=[core], log_dir=tmp_path, restart=FAST
    )
    with servers as (urls, token):
        assert token == TOKEN and servers.alive_urls() == urls
        (first,) = servers.procs
        assert os.sched_getaffinity(first.pid) == {core}  # pinned by the bootstrap
        log = (tmp_path / "env-server-0.log").read_text().splitlines()
        # the human-readable line stays (first on stdout; stderr shares the log), then the ready line
        human = [i for i, line in enumerate(log) if line.startswith(f"composer-jax env-server listening on {urls[0]} ")]
        ready = [i for i, line in enumerate(log) if parse_ready_line(line)]
        assert len(human) == 1 and len(ready) == 1 and human[0] < ready[0]
        assert parse_ready_line(log[ready[0]]) == (urls[0], first.pid)
        assert servers.restart_counts() == [0]

        os.kill(first.pid, signal.SIGKILL)
        assert _until(lambda: first.returncode is not None and gone(first.pid)), "the dead server was not reaped"
        assert servers.wait_alive(1, timeout_s=60) == urls  # the same URL
        (second,) = servers.procs
        assert second.pid != first.pid and os.sched_getaffinity(second.pid) == {core}
        assert httpx.get(urls[0] + "/health", timeout=5).status_code == 200
        assert servers.restart_counts() == [1]
        assert servers.metrics() == {
            "env_servers/alive": 1.0,
            "env_servers/restarts": 1.0,
            "env_servers/given_up": 0.0,
            "env_servers/unresponsive": 0.0,
            "env_servers/restarts_0": 1.0,
        }
    assert servers.procs == [] and gone(second.pid)
    said = caplog.text
    assert f"environment server 0 (pid {first.pid}, {urls[0]}) was killed by SIGKILL; restarting it" in said
    assert f"environment server 0 is back at {urls[0]} (pid {second.pid}, restart 1)" in said


def test_a_hung_server_is_noticed_by_its_health_probes_killed_and_restarted(tmp_path):
    """SIGSTOP: the process lives but answers nothing; two failed probes in a row and it is killed
    and restarted on its URL, counted as unresponsive (tests/rl/test_learner_rejoin.py: the same
    for the only sampler replica of a run, which then rejoins)."""
    probes = RestartPolicy(backoff_s=0.05, max_backoff_s=0.2, health_interval_s=0.3, health_failures=2)
    servers = LocalEnvServers(ENV_FIXTURE_TASKS, token=TOKEN, extra_args=SANDBOX_ARGS, log_dir=tmp_path, restart=probes)
    with servers as (urls, _token):
        (first,) = servers.procs
        time.sleep(1.0)  # healthy: probes pass, nothing restarted
        assert servers.restart_counts() == [0] and servers.metrics()["env_servers/unresponsive"] == 0.0
        os.kill(first.pid, signal.SIGSTOP)
        assert _until(lambda: servers.restart_counts() == [1] and servers.alive_urls() == urls, timeout_s=60)
        assert first.returncode == -signal.SIGKILL  # SIGKILL reaches a stopped process
        assert httpx.get(urls[0] + "/health", timeout=5).status_code == 200
        assert servers.metrics()["env_servers/unresponsive"] == 1.0
        (st,) = servers.statuses()
        assert st.state == "alive" and st.starts == 2 and st.last_failure is not None
        assert f"(pid {first.pid}, {urls[0]}) did not answer /health 2 times in a row" in st.last_failure


def test_replace_starts_a_child_again_on_its_url_without_counting_a_restart(tmp_path):
    """`Launcher.replace`: the learner's planned restart (a vLLM replica on a new version)."""
    servers = LocalEnvServers(ENV_FIXTURE_TASKS, token=TOKEN, extra_args=SANDBOX_ARGS, log_dir=tmp_path, restart=FAST)
    with servers as (urls, _token):
        (first,) = servers.procs
        assert servers.replace(0, timeout_s=60, why="a test") == urls[0]
        (second,) = servers.procs
        assert second.pid != first.pid and gone(first.pid)
        assert httpx.get(urls[0] + "/health", timeout=5).status_code == 200
        assert servers.restart_counts() == [0] and servers.metrics()["env_servers/restarts"] == 0.0
        with pytest.raises(EnvServerError, match="give a child index from 0 to 0"):
            servers.replace(1, timeout_s=1)


def test_a_server_whose_port_was_taken_moves_and_its_url_is_updated_in_place(tmp_path):
    servers = LocalEnvServers(
        ENV_FIXTURE_TASKS, token=TOKEN, extra_args=SANDBOX_ARGS, log_dir=tmp_path, restart=RestartPolicy(backoff_s=0.5)
    )
    with servers as (urls, _):
        old = urls[0]
        (proc,) = servers.procs
        taker = socket.socket()
        try:
            taker.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(10)
            taker.bind(("127.0.0.1", int(old.rsplit(":", 1)[1])))  # before the restart (0.5 s later)
            taker.listen(1)
            assert _until(lambda: servers.restart_counts() == [2] and servers.alive_urls(), timeout_s=60)
        finally:
            taker.close()
        assert urls[0] != old and servers.alive_urls() == urls  # the list the caller holds
        assert httpx.get(urls[0] + "/health", timeout=5).status_code == 200
    assert "cannot bind 127.0.0.1:" in (tmp_path / "env-server-0.log").read_text()


def test_a_server_that_fails_at_once_is_given_up_with_the_reason(tmp_path, caplog):
    tasks = tmp_path / "tasks"
    shutil.copytree(ENV_FIXTURE_TASKS, tasks)
    policy = RestartPolicy(max_restarts=2, backoff_s=0.05)
    servers = LocalEnvServers(tasks, token=TOKEN, extra_args=SANDBOX_ARGS, log_dir=tmp_path / "logs", restart=policy)
    with servers as (urls, _):
        (proc,) = servers.procs
        tasks.rename(tmp_path / "moved")  # every restart now exits at once: no such tasks directory
        os.kill(proc.pid, signal.SIGKILL)
        assert _until(lambda: servers.given_up(), timeout_s=60), "the failing server was never given up on"
        (reason,) = servers.given_up().values()
        assert reason.startswith("environment server 0 given up after 2 restart(s) within 600 s: restart 2 exited")
        assert "exited with status 2" in reason
        assert servers.restart_counts() == [2] and servers.alive_urls() == [] and servers.procs == []
        assert servers.metrics()["env_servers/given_up"] == 1.0
        with pytest.raises(EnvServerError, match=r"0 of 1 env_servers alive after 0.2 s, 1 wanted \(environment serv"):
            servers.wait_alive(1, timeout_s=0.2)
    given_up = [r for r in caplog.records if r.levelno == logging.ERROR and "given up" in r.getMessage()]
    assert len(given_up) == 1 and f"--tasks {tasks}: not a directory" in given_up[0].getMessage()  # the log's tail


def test_a_first_start_that_fails_raises_with_the_log_tail(tmp_path):
    servers = LocalEnvServers(ENV_FIXTURE_TASKS, extra_args=("--max-sessions", "0"), log_dir=tmp_path)
    with pytest.raises(
        EnvServerError, match=r"(?s)environment server 0 exited with status 2; its log .*--max-sessions: 0 must be > 0"
    ):
        with servers:
            pass
    assert servers.procs == [] and servers.restart_counts() == [0]


def test_a_start_past_its_bound_names_the_timeout(tmp_path):
    # no server is up 0.01 s after its start: it is killed and the error names the bound
    servers = LocalEnvServers(ENV_FIXTURE_TASKS, extra_args=SANDBOX_ARGS, log_dir=tmp_path, start_timeout_s=0.01)
    with pytest.raises(
        EnvServerError, match=r"environment server 0 did not print its ready line within start_timeout_s=0.01 s"
    ):
        servers.start()
    assert servers.procs == []


def test_children_outlive_the_thread_that_started_them(tmp_path):
    # the kernel's death signal follows the thread that forked a child: the launcher's own thread forks
    servers = LocalEnvServers(ENV_FIXTURE_TASKS, 2, token=TOKEN, extra_args=SANDBOX_ARGS, log_dir=tmp_path)
    starter = threading.Thread(target=servers.start)
    starter.start()
    starter.join()
    try:
        assert len(servers.urls) == 2
        time.sleep(1.0)
        assert all(p.poll() is None for p in servers.procs)
        assert servers.alive_urls() == servers.urls
        assert all(httpx.get(u + "/health", timeout=5).status_code == 200 for u in servers.urls)
    finally:
        servers.stop()
    assert servers.procs == []


LAUNCHER = """
import json, sys, time
from composer_jax.rl.rollout.env_servers import LocalEnvServers
servers = LocalEnvServers(sys.argv[1], 2, token=sys.argv[2], extra_args=tuple(sys.argv[3:]))
with servers as (urls, _):
    print(json.dumps({"urls": urls, "pids": [p.pid for p in servers.procs]}), flush=True)
    time.sleep(600)
"""


def test_no_child_outlives_a_sigkilled_launcher(tmp_path):
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(ENV_FIXTURE_TASKS), TOKEN, *SANDBOX_ARGS],
        stdout=subprocess.PIPE,
        text=True,
    )
    shell: threading.Thread | None = None
    pids: list[int] = []
    tools: list[int] = []
    try:
        assert launcher.stdout is not None
        started = json.loads(launcher.stdout.readline())
        urls, pids = started["urls"], started["pids"]
        assert len(pids) == 2 and all(not gone(p) for p in pids)
        # a tool process inside server 0's sandbox, still running when the launcher dies
        headers = {"Authorization": f"Bearer {TOKEN}"}
        sid = httpx.post(urls[0] + "/sessions", json={"task_id": "fix-add"}, headers=headers, timeout=30).json()
        call = {"calls": [{"id": "c1", "name": "run_shell", "arguments": {"command": "sleep 300"}}]}

        def run_shell() -> None:
            try:
                httpx.post(f"{urls[0]}/sessions/{sid['session_id']}/tools", json=call, headers=headers, timeout=60)
            except httpx.HTTPError:
                pass  # the server dies under it

        shell = threading.Thread(target=run_shell, daemon=True)
        shell.start()
        assert _until(lambda: any("sleep 300" in cmdline(p) for p in descendants(pids[0]))), "no tool process"
        tools = descendants(pids[0])
    finally:
        launcher.kill()  # SIGKILL: no teardown runs in the launcher
        launcher.wait(10)
    everything = pids + tools
    try:
        assert _until(lambda: all(gone(p) for p in everything), timeout_s=20), [
            (p, cmdline(p)) for p in everything if not gone(p)
        ]
    finally:
        for p in everything:  # what a failed run left (the servers' SIGTERM handling takes their tools along)
            if not gone(p):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p, signal.SIGTERM)
        if shell is not None:
            shell.join(10)


@needs_bwrap  # bubblewrap's --die-with-parent (the unsafe backend's tools go only with a server's shutdown)
def test_a_sigkilled_servers_sandboxed_tools_go_with_it_and_it_is_restarted(tmp_path):
    servers = LocalEnvServers(ENV_FIXTURE_TASKS, token=TOKEN, log_dir=tmp_path, restart=FAST)
    with servers as (urls, _):
        (proc,) = servers.procs
        headers = {"Authorization": f"Bearer {TOKEN}"}
        sid = httpx.post(urls[0] + "/sessions", json={"task_id": "fix-add"}, headers=headers, timeout=30).json()
        call = {"calls": [{"id": "c1", "name": "run_shell", "arguments": {"command": "sleep 300"}}]}

        def run_shell() -> None:
            with contextlib.suppress(httpx.HTTPError):  # the server dies under it
                httpx.post(f"{urls[0]}/sessions/{sid['session_id']}/tools", json=call, headers=headers, timeout=60)

        shell = threading.Thread(target=run_shell, daemon=True)
        shell.start()
        assert _until(lambda: any("sleep 300" in cmdline(p) for p in descendants(proc.pid))), "no tool process"
        tools = descendants(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)  # no shutdown runs in the server
        try:
            assert _until(lambda: all(gone(p) for p in tools), timeout_s=20), [
                (p, cmdline(p)) for p in tools if not gone(p)
            ]
        finally:
            for p in tools:
                if not gone(p):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(p, signal.SIGKILL)
        assert servers.wait_alive(1, timeout_s=60) == urls
        shell.join(10)


def test_bad_arguments_get_clear_errors(tmp_path):
    allowed = sorted(os.sched_getaffinity(0))
    with pytest.raises(EnvServerError, match=re.escape(f"cores=[-1]: give CPU cores out of this process's {allowed}")):
        LocalEnvServers(ENV_FIXTURE_TASKS, cores=[-1])
    with pytest.raises(EnvServerError, match=r"cores=\[\]: give CPU cores"):
        LocalEnvServers(ENV_FIXTURE_TASKS, cores=[])
    with pytest.raises(ValueError, match="count=0 local environment servers: give at least 1"):
        LocalEnvServers(ENV_FIXTURE_TASKS, 0)
    with pytest.raises(EnvServerError, match="token must be at least 16 characters"):
        LocalEnvServers(ENV_FIXTURE_TASKS, token="short")
    with pytest.raises(LaunchError, match=r"max_restarts=-1: expected an integer >= 0"):
        RestartPolicy(max_restarts=-1)
    with pytest.raises(LaunchError, match=r"backoff_s=0: expected seconds > 0"):
        RestartPolicy(backoff_s=0)
    with pytest.raises(EnvServerError, match=r"start_timeout_s=0; accepted: seconds > 0"):
        LocalEnvServers(ENV_FIXTURE_TASKS, start_timeout_s=0)
    spec = ServiceSpec("c", lambda host, port: [], tmp_path / "c.log")
    with pytest.raises(LaunchError, match="no children to launch"):
        Launcher([])
    with pytest.raises(LaunchError, match=r"count=3; accepted: an int from 1 to 1"):
        Launcher([spec]).wait_alive(3)
    assert RestartPolicy(backoff_s=1, max_backoff_s=5).delay(0) == 1 and RestartPolicy(max_backoff_s=5).delay(9) == 5
