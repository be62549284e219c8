"""Attacks through run_shell and the file tools, each of which must stay contained.

Every test drives a live `composer-jax env-server` (bubblewrap backend) over HTTP, like an agent
would, and checks containment from the host side where it can (files not created, processes not
left, the server and other sessions unaffected).
"""

from __future__ import annotations

import os
import secrets
import threading
import time
from pathlib import Path

import pytest
from support.live_server import call, requires_bwrap

pytestmark = requires_bwrap


def shell(http, sid, command, timeout_s=10):
    res = call(http, sid, "run_shell", command=command, timeout_s=timeout_s)
    assert res["ok"], res
    return res["result"]


def assert_server_healthy(http, sid):
    assert http.get("/health").status_code == 200
    out = shell(http, sid, "echo alive")
    assert out["stdout"] == "alive\n"


# ------------------------------------------------------------------ reading what is not yours
def test_cannot_read_server_token(server, http, session):
    out = shell(http, session, "cat /proc/*/cmdline /proc/*/environ 2>/dev/null | tr '\\0' ' '; ps aux; env")
    assert server.token not in out["stdout"] + out["stderr"]


def test_cannot_see_host_processes(server, http, session):
    out = shell(http, session, f"ls /proc | grep -E '^[0-9]+$' | wc -l; kill -0 {server.proc.pid}; echo rc=$?")
    assert int(out["stdout"].split()[0]) < 10  # only the sandbox's own processes
    assert "rc=1" in out["stdout"]


def test_cannot_read_other_sessions_workspace(http, session):
    other = http.post("/sessions", json={"task_id": "write-hello"}).json()["session_id"]
    try:
        marker = "secret-" + secrets.token_hex(8)
        assert call(http, other, "edit_file", path="secret.txt", new_string=marker)["ok"]
        out = shell(
            http,
            session,
            f"cat /proc/self/mountinfo; grep -rs {marker} /app /tmp /root /home /work /var "
            "/mnt /opt 2>/dev/null; find / -path /proc -prune -o -path /usr -prune -o "
            "-name secret.txt -print 2>/dev/null; echo done",
        )
        assert marker not in out["stdout"] and "secret.txt" not in out["stdout"] and other not in out["stdout"]
        res = call(http, session, "read_file", path=f"../{other}/app/secret.txt")
        assert not res["ok"] and "leaves the workspace" in res["error"]
    finally:
        http.delete(f"/sessions/{other}")


def test_cannot_read_host_home_or_repository(http, session):
    out = shell(http, session, f"ls /root 2>&1; ls {Path(__file__).parent} 2>&1; cat /etc/shadow 2>&1")
    assert "conftest.py" not in out["stdout"]
    assert "No such file" in out["stdout"] or "Permission denied" in out["stdout"]
    assert "root:" not in out["stdout"]


def test_sys_and_cgroups_not_visible(http, session):
    out = shell(http, session, "ls -A /sys | wc -l; echo $$ > /sys/fs/cgroup/pids/cgroup.procs; echo rc=$?")
    assert out["stdout"].split()[0] == "0" and "rc=1" in out["stdout"]


# ------------------------------------------------------------------ writing outside /app
@pytest.mark.parametrize("target", ["/usr/cj-escape", "/etc/cj-escape", "/cj-escape", "/root/cj-escape"])
def test_cannot_write_system_paths(http, session, target):
    out = shell(http, session, f"echo x > {target}; echo rc=$?")
    assert "rc=1" in out["stdout"]
    assert not os.path.exists(target)


def test_tmp_is_private_tmpfs(http, session):
    name = "cj-escape-" + secrets.token_hex(6)
    out = shell(http, session, f"echo x > /tmp/{name} && ls /tmp/{name}")
    assert name in out["stdout"]
    assert not os.path.exists(f"/tmp/{name}")


def test_cannot_mount_or_gain_privileges(http, session):
    out = shell(http, session, "mount -t tmpfs none /app 2>&1; echo rc=$?; grep CapEff /proc/self/status; id -u")
    assert "rc=0" not in out["stdout"]
    assert "CapEff:\t0000000000000000" in out["stdout"]
    assert out["stdout"].strip().splitlines()[-1] != "0"


# ------------------------------------------------------------------ network
@pytest.mark.parametrize("host", ["1.1.1.1", "127.0.0.1"])
def test_no_network(server, http, session, host):
    port = server.url.rsplit(":", 1)[1]
    code = (
        f"import socket; s=socket.socket(); s.settimeout(2); "
        f"s.connect(('{host}', {port if host == '127.0.0.1' else 80})); print('CONNECTED')"
    )
    out = shell(http, session, f'python3 -c "{code}" 2>&1')
    assert "CONNECTED" not in out["stdout"]
    assert "unreachable" in out["stdout"] or "refused" in out["stdout"]


# ------------------------------------------------------------------ resource exhaustion
def test_fork_bomb_contained(http, session):
    out = shell(http, session, ":(){ :|:& };:; sleep 2", timeout_s=4)
    assert out["timed_out"] or out["exit_code"] is not None
    assert_server_healthy(http, session)


def test_process_count_limited(http, session):
    out = shell(http, session, "ulimit -u; for i in $(seq 400); do sleep 3 & done", timeout_s=4)
    assert int(out["stdout"].split()[0]) <= 1024
    assert "Resource temporarily unavailable" in out["stderr"]


def test_memory_bomb_contained(http, session):
    out = shell(http, session, 'python3 -c "x = bytearray(16 * 2**30)" 2>&1; echo rc=$?', timeout_s=20)
    assert "MemoryError" in out["stdout"] or "Killed" in out["stdout"]
    assert_server_healthy(http, session)


def test_disk_fill_stops_at_quota(http, session):
    out = shell(
        http, session, "dd if=/dev/zero of=/app/fill bs=1M count=3000 2>&1; echo rc=$?; rm -f /app/fill", timeout_s=30
    )
    assert "rc=0" not in out["stdout"]
    assert "No space left" in out["stdout"] or "rc=153" in out["stdout"]


def test_tmp_fill_stops_at_quota(http, session):
    out = shell(
        http, session, "dd if=/dev/zero of=/tmp/fill bs=1M count=3000 2>&1; echo rc=$?; df -m /tmp", timeout_s=30
    )
    # Either the tmpfs size (ENOSPC) or RLIMIT_FSIZE (SIGXFSZ: 128 + 25 = 153) stops it.
    assert "No space left" in out["stdout"] or "rc=153" in out["stdout"]
    assert int(out["stdout"].split()[-5]) <= 256  # df: the /tmp tmpfs is 256 MiB


def test_infinite_loop_times_out(http, session):
    start = time.monotonic()
    out = shell(http, session, "while true; do :; done", timeout_s=1.5)
    assert out["timed_out"] and out["exit_code"] is None
    assert time.monotonic() - start < 6


def test_huge_output_capped(http, session):
    out = shell(http, session, "yes 0123456789", timeout_s=20)
    assert out["truncated"]
    assert len(out["stdout"]) <= 64 * 1024
    assert out["duration_s"] < 10  # killed on overflow, not at the wall clock


def test_background_processes_killed_with_command(http, session):
    marker = str(900000 + secrets.randbelow(99999))
    shell(http, session, f"(setsid nohup sleep {marker} >/dev/null 2>&1 &); echo started")
    time.sleep(0.3)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        assert marker.encode() not in cmdline, "a background process outlived its sandbox"


def test_cannot_kill_outside_processes(server, http, session):
    out = shell(http, session, f"kill -9 -1; kill -9 {server.proc.pid} {os.getpid()} 2>&1; echo done")
    assert "done" in out["stdout"]
    assert server.proc.poll() is None
    assert_server_healthy(http, session)


def test_misbehaving_session_loses_no_other_state(http, session):
    other = http.post("/sessions", json={"task_id": "fix-add"}).json()["session_id"]
    try:
        assert call(http, other, "edit_file", path="calc.py", old_string="a - b", new_string="a + b")["ok"]
        shell(http, session, 'python3 -c "x = bytearray(16 * 2**30)"; :(){ :|:& };:', timeout_s=3)
        assert "a + b" in call(http, other, "read_file", path="calc.py")["result"]["content"]
        assert http.post(f"/sessions/{other}/grade").json()["reward"] == 1.0
    finally:
        http.delete(f"/sessions/{other}")


# ------------------------------------------------------------------ path traversal through the file tools
@pytest.mark.parametrize("path", ["../../etc/passwd", "/etc/passwd", "/app/../etc/passwd", "a/../../x"])
def test_dotdot_and_absolute_paths_refused(http, session, path):
    for name, args in (
        ("read_file", {"path": path}),
        ("edit_file", {"path": path, "new_string": "pwned"}),
        ("list_dir", {"path": path}),
    ):
        res = call(http, session, name, **args)
        assert not res["ok"] and ("outside the workspace" in res["error"] or "leaves the workspace" in res["error"])


def test_symlink_to_host_file_refused(http, session):
    shell(http, session, "ln -s /etc/passwd /app/link; ln -s ../../../etc/hostname /app/rel")
    before = Path("/etc/passwd").read_bytes()
    for name, args in (
        ("read_file", {"path": "link"}),
        ("read_file", {"path": "rel"}),
        ("edit_file", {"path": "link", "old_string": "root", "new_string": "pwned"}),
    ):
        res = call(http, session, name, **args)
        assert not res["ok"], res
    res = call(http, session, "edit_file", path="link", new_string="pwned")  # whole-file write
    assert not res["ok"]
    assert Path("/etc/passwd").read_bytes() == before


def test_symlinked_directory_refused_everywhere(http, session):
    shell(http, session, "ln -s / /app/hostroot")
    for name, args in (
        ("read_file", {"path": "hostroot/etc/hostname"}),
        ("list_dir", {"path": "hostroot"}),
        ("grep", {"pattern": "root", "path": "hostroot/etc"}),
        ("edit_file", {"path": "hostroot/tmp/cj-escape", "new_string": "x"}),
    ):
        res = call(http, session, name, **args)
        assert not res["ok"], (name, res)
    assert not os.path.exists("/tmp/cj-escape")
    res = call(http, session, "grep", pattern="^root:")  # the tree walk must not follow hostroot
    assert res["ok"] and res["result"]["matches"] == []


def test_symlink_inside_workspace_allowed(http, session):
    shell(http, session, "mkdir -p sub && ln -s /app/calc.py sub/alias.py")
    res = call(http, session, "read_file", path="sub/alias.py")
    assert res["ok"] and "def add" in res["result"]["content"]


def test_fifo_does_not_hang_file_tools(http, session):
    shell(http, session, "mkfifo /app/pipe")
    start = time.monotonic()
    res = call(http, session, "read_file", path="pipe")
    assert not res["ok"] and "not a regular file" in res["error"]
    assert call(http, session, "grep", pattern="x")["ok"]
    assert time.monotonic() - start < 5


def test_symlink_swap_race_never_escapes(server, http, session):
    """A shell loop swaps a directory for a symlink to /etc while read_file races it."""
    script = "for i in $(seq 600); do rm -rf d; mkdir d; echo safe > d/passwd; rm -rf d; ln -s /etc d; done; rm -rf d"
    swapper = threading.Thread(target=lambda: shell(server.client(), session, script, timeout_s=30))
    swapper.start()
    seen = []
    while swapper.is_alive():
        r = http.post(
            f"/sessions/{session}/tools", json={"calls": [{"name": "read_file", "arguments": {"path": "d/passwd"}}] * 8}
        )
        for res in r.json()["results"]:
            if res["ok"]:
                seen.append(res["result"]["content"])
    swapper.join()
    assert all("root:" not in s for s in seen)
