"""A hostile agent against grading and the server itself (issue 10), through the public HTTP API.

The agent swaps a directory for a symlink (renameat2 RENAME_EXCHANGE in a tight loop, so the swap
is atomic and happens millions of times a second) while the session is graded: grading must never
read a host file through the swapped link, never block on a FIFO, never stall other sessions, and
always release its mounts. Every test here failed on the code before the fix.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from support.live_server import FIXTURE_TASKS, LiveServer, call, requires_bwrap
from support.metrics_scrape import parse, scrape

pytestmark = requires_bwrap

# Swaps the names d (a real directory of regular files f0..f{n-1}) and e (a symlink to `target`,
# a host path) atomically, as fast as it can, for `seconds`.
SWAP = """
import ctypes, os, sys, time
target, seconds, n = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
libc = ctypes.CDLL(None, use_errno=True)
if not os.path.lexists("d"):
    os.mkdir("d")
    for i in range(n):
        with open(f"d/f{i}", "w") as f:
            f.write("safe\\n")
    os.symlink(target, "e")
end = time.time() + seconds
while time.time() < end:
    for _ in range(1000):
        libc.renameat2(-100, b"d", -100, b"e", 2)  # RENAME_EXCHANGE
print("swapped")
"""


def swap_command(target: Path, seconds: float, n: int = 20) -> str:
    return f"python3 -c '{SWAP}' {target} {seconds} {n}"


def mounts_below(path: Path) -> list[str]:
    base = str(path)
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(base)]


@pytest.fixture
def canary(tmp_path):
    """A root-only host directory holding a root-only file with random content."""
    d = tmp_path / "root-only"
    d.mkdir(mode=0o700)
    secret = "canary-" + secrets.token_hex(16)
    for i in range(20):  # the same names as the agent's regular files, and one more
        (d / f"f{i}").write_text(secret + "\n")
    (d / "secret.txt").write_text(secret + "\n")
    for f in d.iterdir():
        f.chmod(0o600)
    return d, secret


def test_grade_during_symlink_swap_never_reads_host_files(server, canary) -> None:
    """Grades run while run_shell keeps swapping a directory for a symlink to a root-only host
    directory for 10 s, and on until three grades ran (a grade is a few sandboxed commands, and
    grades and tool calls are serialised): no byte of the canary appears in any response (issue 10,
    defect 1)."""
    target, secret = canary
    http = server.client()
    sid = http.post("/sessions", json={"task_id": "fix-add"}).json()["session_id"]
    bodies: list[str] = []
    start = time.monotonic()
    grades = 0

    def swapping() -> bool:
        elapsed = time.monotonic() - start
        return elapsed < 10 or (grades < 3 and elapsed < 120)

    def swapper():
        with server.client() as c:
            while swapping():
                r = c.post(
                    f"/sessions/{sid}/tools",
                    json={"calls": [{"name": "run_shell", "arguments": {"command": swap_command(target, 0.5)}}]},
                )
                bodies.append(r.text)
                assert r.status_code in (200, 409), r.text

    thread = threading.Thread(target=swapper)
    thread.start()
    try:
        while thread.is_alive():
            r = http.post(f"/sessions/{sid}/grade")
            bodies.append(r.text)
            grades += 1
        r = http.post(f"/sessions/{sid}/grade")  # and once more, with the link in whatever state
        bodies.append(r.text)
        assert r.status_code == 200, r.text
    finally:
        thread.join()
        http.delete(f"/sessions/{sid}")
    assert grades >= 3
    leaked = [b for b in bodies if secret in b]
    assert not leaked, leaked[0][:500]


def test_tool_calls_and_grades_are_serialised(server):
    """A grade waits for the tool calls in flight; calls made during a grade get 409."""
    http = server.client()
    sid = http.post("/sessions", json={"task_id": "fix-add"}).json()["session_id"]
    try:
        # A verifier that takes ~2 s: the tests import calc.py.
        assert call(http, sid, "edit_file", path="calc.py", new_string="import time\ntime.sleep(2)\n")["ok"]
        done = {}

        def slow_shell():
            with server.client() as c:
                done["shell"] = c.post(
                    f"/sessions/{sid}/tools",
                    json={"calls": [{"name": "run_shell", "arguments": {"command": "sleep 1.5; echo late >> log"}}]},
                )
                done["shell_at"] = time.monotonic()

        t = threading.Thread(target=slow_shell)
        t.start()
        time.sleep(0.3)

        def grade():
            with server.client() as c:
                done["grade"] = c.post(f"/sessions/{sid}/grade")

        g = threading.Thread(target=grade)
        g.start()
        time.sleep(0.5)
        r = http.post(f"/sessions/{sid}/tools", json={"calls": [{"name": "read_file", "arguments": {"path": "log"}}]})
        assert r.status_code == 409 and r.json()["error"]["code"] == "session_busy", r.text
        assert "being graded" in r.json()["error"]["message"]
        r = http.post(f"/sessions/{sid}/grade")
        assert r.status_code == 409 and "already being graded" in r.json()["error"]["message"]
        t.join()
        g.join()
        assert done["shell"].status_code == 200
        body = done["grade"].json()
        assert done["grade"].status_code == 200, body
        assert "+late" in body["diff"]  # the grade saw the finished command's write
        assert call(http, sid, "read_file", path="log")["ok"]  # and calls work again afterwards
    finally:
        http.delete(f"/sessions/{sid}")


def test_fifo_swap_during_grade_does_not_hang_server(tmp_path) -> None:
    """The swapped-in host directory holds FIFOs with the names of the agent's regular files:
    grading must not block on one, and /health must keep answering (defect 2)."""
    fifos = tmp_path / "fifos"
    fifos.mkdir(mode=0o700)
    for i in range(20):
        os.mkfifo(fifos / f"f{i}", 0o600)
    server = LiveServer()
    try:
        http = server.client()
        sid = http.post("/sessions", json={"task_id": "fix-add"}).json()["session_id"]
        results: list[httpx.Response | Exception] = []
        stop = time.monotonic() + 6

        def swapper():
            with httpx.Client(base_url=server.url, headers=server.headers, timeout=30) as c:
                while time.monotonic() < stop:
                    try:
                        c.post(
                            f"/sessions/{sid}/tools",
                            json={"calls": [{"name": "run_shell", "arguments": {"command": swap_command(fifos, 0.5)}}]},
                        )
                    except httpx.HTTPError:
                        return

        def grader():
            with httpx.Client(base_url=server.url, headers=server.headers, timeout=30) as c:
                while time.monotonic() < stop:
                    try:
                        results.append(c.post(f"/sessions/{sid}/grade"))
                    except httpx.HTTPError as exc:
                        results.append(exc)
                        return

        threads = [threading.Thread(target=f, daemon=True) for f in (swapper, grader)]
        for t in threads:
            t.start()
        slow = []
        while any(t.is_alive() for t in threads):
            start = time.monotonic()
            try:
                ok = httpx.get(server.url + "/health", timeout=3).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok or time.monotonic() - start > 2:
                slow.append(time.monotonic() - start)
                break
            time.sleep(0.1)
        assert not slow, "the server stopped answering /health during a grade"
        for t in threads:
            t.join(5)
        assert results
        assert all(isinstance(r, httpx.Response) and r.status_code == 200 for r in results), results
    finally:
        server.stop()


def _huge_task(tmp_path: Path) -> Path:
    tasks = tmp_path / "tasks"
    shutil.copytree(FIXTURE_TASKS / "fix-add", tasks / "fix-add")
    shutil.copytree(FIXTURE_TASKS / "fix-add", tasks / "fix-add-big")
    toml = tasks / "fix-add-big" / "task.toml"
    toml.write_text(toml.read_text().replace("storage_mb = 64", "storage_mb = 600"))
    return tasks


def _rss_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(field)


def test_huge_workspace_grade_keeps_other_sessions_fast(tmp_path):
    """Grading a ~300 MB workspace does not stall the server: another session's calls keep being
    answered while it runs, none waiting for a large part of the grade (a blocked event loop would
    hold one for about the whole grade; measured as a ratio, not a wall time, so a loaded machine
    slows both sides alike), and the server's memory does not grow by the workspace's size
    (defect 3)."""
    server = LiveServer(tasks=_huge_task(tmp_path))
    try:
        http = server.client()
        big = http.post("/sessions", json={"task_id": "fix-add-big"}).json()["session_id"]
        other = http.post("/sessions", json={"task_id": "fix-add"}).json()["session_id"]
        fill = (
            "mkdir -p big && python3 -c \"d = ('x' * 1023 + chr(10)) * 1024\n"
            "for i in range(300): open(f'big/f{i}', 'w').write(d)\" && du -sm big"
        )
        out = call(http, big, "run_shell", command=fill, timeout_s=60)
        assert out["ok"] and out["result"]["exit_code"] == 0, out
        for _ in range(5):  # warm up
            call(http, other, "read_file", path="calc.py")
        hwm_before = _rss_kib(server.proc.pid, "VmRSS")
        graded = {}

        def grade():
            with server.client() as c:
                graded["r"] = c.post(f"/sessions/{big}/grade")

        g = threading.Thread(target=grade)
        grade_start = time.monotonic()
        g.start()
        latencies = []
        while g.is_alive():
            start = time.monotonic()
            assert call(http, other, "read_file", path="calc.py")["ok"]
            assert http.get("/health").status_code == 200
            latencies.append(time.monotonic() - start)
            time.sleep(0.01)
        g.join()
        grade_s = time.monotonic() - grade_start
        assert graded["r"].status_code == 200, graded["r"].text
        assert "diff truncated" in graded["r"].json()["diff"]
        latencies.sort()
        assert len(latencies) >= 5, f"{len(latencies)} calls answered during a {grade_s:.1f} s grade"
        assert latencies[-1] < 0.25 * grade_s, (
            f"a call waited {latencies[-1] * 1e3:.0f} ms of the {grade_s * 1e3:.0f} ms grade "
            f"({len(latencies)} calls, median {latencies[len(latencies) // 2] * 1e3:.0f} ms)"
        )
        grown_mb = (_rss_kib(server.proc.pid, "VmHWM") - hwm_before) / 1024
        assert grown_mb < 100, f"server memory grew by {grown_mb:.0f} MB while grading"
    finally:
        server.stop()


def test_grade_interrupted_by_close_or_kill_leaves_no_mount(tmp_path):
    """A grade stopped midway (session closed, server shut down, server killed) leaves no mount
    and no scratch directory behind; a restarted server sweeps what a killed one left (defect 4)."""
    work = tmp_path / "work"
    server = LiveServer("--work-dir", str(work))
    try:
        http = server.client()

        def start_slow_grade() -> tuple[str, threading.Thread, dict]:
            sid = http.post("/sessions", json={"task_id": "fix-add"}).json()["session_id"]
            assert call(http, sid, "edit_file", path="calc.py", new_string="import time\ntime.sleep(60)\n")["ok"]
            out: dict = {}

            def grade():
                with server.client() as c:
                    try:
                        out["r"] = c.post(f"/sessions/{sid}/grade")
                    except httpx.HTTPError as exc:
                        out["r"] = exc

            t = threading.Thread(target=grade, daemon=True)
            t.start()
            deadline = time.monotonic() + 20
            while not any("/job-" in m for m in mounts_below(work / "sessions" / sid)):
                assert time.monotonic() < deadline, "the grade never mounted its copy"
                time.sleep(0.05)
            return sid, t, out

        # 1. The session is closed while its grade runs.
        sid, t, out = start_slow_grade()
        assert http.delete(f"/sessions/{sid}").status_code == 200
        t.join(30)
        assert isinstance(out["r"], httpx.Response) and out["r"].status_code == 404, out
        assert mounts_below(work / "sessions" / sid) == []
        assert not (work / "sessions" / sid).exists()
        assert scrape(http)("cj_env_http_requests_total", code="5xx") == 0

        # 2. The server is killed mid-grade: its mounts stay until the next server sweeps them.
        sid, t, out = start_slow_grade()
        server.proc.send_signal(signal.SIGKILL)
        server.proc.wait(10)
        assert mounts_below(work) != []
        server = LiveServer("--work-dir", str(work))
        assert mounts_below(work / "sessions") == []
        assert list((work / "sessions").iterdir()) == []
        with pytest.raises(RuntimeError, match="in use by another env-server"):
            LiveServer("--work-dir", str(work))  # a live server's work dir is never swept

        # 3. Shut down (SIGTERM) mid-grade.
        http = server.client()
        sid, t, out = start_slow_grade()
        server.stop()
        assert server.proc.returncode is not None
        assert mounts_below(work) == []
    finally:
        server.stop()


def test_unhandled_error_is_a_counted_500(tmp_path, monkeypatch):
    """An error inside a grade is a JSON 500, counted in cj_env_http_requests_total (defect 4)."""
    from fastapi.testclient import TestClient

    from composer_jax.env.sandbox.runner import LocalProcessSandbox
    from composer_jax.env.server.app import create_app
    from composer_jax.env.server.session import SessionManager
    from composer_jax.env.tasks.store import TaskStore

    manager = SessionManager(
        TaskStore(FIXTURE_TASKS, tmp_path / "cache"), LocalProcessSandbox(), work_dir=tmp_path / "w"
    )

    async def broken(session_id):
        raise RuntimeError("copy failed midway")

    monkeypatch.setattr(manager, "grade", broken)
    headers = {"Authorization": "Bearer " + "t" * 32}
    with TestClient(create_app(manager, "t" * 32), raise_server_exceptions=False) as client:
        sid = client.post("/sessions", json={"task_id": "fix-add"}, headers=headers).json()["session_id"]
        r = client.post(f"/sessions/{sid}/grade", headers=headers)
        assert r.status_code == 500 and r.json()["error"]["code"] == "internal_error"
        assert parse(client.get("/metrics", headers=headers).text)("cj_env_http_requests_total", code="5xx") == 1
    assert mounts_below(tmp_path / "w") == [] and not (tmp_path / "w").joinpath("sessions").exists()


def test_sandbox_shows_the_verifier_toolchain_not_the_servers_venv(tmp_path):
    """The server's virtualenv (here under /tmp, as in defect 5) is not visible in a session: its
    python3 is the verifier toolchain's at /opt/verifier (pytest importable, the server's packages
    not), nothing of the venv's directory is listed, and the grade says which interpreter ran."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    parent_site = next(p for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    (site / "parent.pth").write_text(parent_site + "\n")  # the server's packages (fastapi...)
    tasks = tmp_path / "tasks"
    shutil.copytree(FIXTURE_TASKS / "fix-add", tasks / "fix-add")
    shutil.copytree(FIXTURE_TASKS / "fix-add", tasks / "needs-module")
    toml = tasks / "needs-module" / "task.toml"
    toml.write_text(toml.read_text().replace('python_modules = ["pytest"]', 'python_modules = ["no_such_module_cj"]'))
    server = LiveServer(tasks=tasks, python=str(venv / "bin" / "python"))
    try:
        http = server.client()
        sid = http.post("/sessions", json={"task_id": "fix-add"}).json()["session_id"]
        command = (
            'python3 -c "import sys, pytest; print(sys.prefix)"; echo "$PATH"; '
            f"ls {venv} {parent_site} >/dev/null 2>&1 || echo unseen; "
            'python3 -c "import fastapi" 2>/dev/null || echo no-fastapi; '
            "echo $(ls -A / | tr '\\n' ,)"
        )
        out = call(http, sid, "run_shell", command=command)
        prefix, path, unseen, no_fastapi, root = out["result"]["stdout"].split()
        # nothing of the host's own directories: its home, the project, the Python installation's path
        host = {Path.home().parts[1], Path(__file__).resolve().parts[1], Path(sys.base_prefix).resolve().parts[1]}
        host -= {"usr", "tmp", "opt", "etc", "bin", "lib", "lib64", "sbin"}
        assert not host & set(root.strip(",").split(",")), (host, root)
        assert prefix == "/opt/verifier", out
        assert path.split(":")[0] == "/opt/verifier/bin"
        assert (unseen, no_fastapi) == ("unseen", "no-fastapi")
        grade = http.post(f"/sessions/{sid}/grade").json()
        assert grade["reward"] == 0 and grade["interpreter"]["python"].startswith("/opt/verifier"), grade
        # A task whose declared test dependency the sandbox's python3 lacks: said, tests not run.
        sid = http.post("/sessions", json={"task_id": "needs-module"}).json()["session_id"]
        grade = http.post(f"/sessions/{sid}/grade").json()
        assert grade["reward"] == 0 and "cannot import no_such_module_cj" in grade["error"], grade
        assert "/opt/verifier" in grade["error"] and grade["output_tail"] == ""
    finally:
        server.stop()


# ------------------------------------------------------------------ smaller (defect 6)
def test_schema_and_docs_need_the_token(server):
    for path in ("/openapi.json", "/docs", "/redoc"):
        assert httpx.get(server.url + path).status_code in (401, 404), path
    with server.client() as c:
        assert c.get("/openapi.json").status_code == 200 and c.get("/docs").status_code == 200
    assert httpx.get(server.url + "/health").status_code == 200


def test_chunked_body_over_limit_is_413(server):
    def chunks():
        for _ in range(50):
            yield b" " * 2**20

    r = httpx.post(
        server.url + "/sessions",
        content=chunks(),
        headers={**server.headers, "Content-Type": "application/json"},
        timeout=60,
    )
    assert r.status_code == 413 and r.json()["error"]["code"] == "body_too_large", r.text
    with server.client() as c:  # a small chunked body still works
        r = c.post(
            "/sessions", content=iter([b'{"task_id": ', b'"fix-add"}']), headers={"Content-Type": "application/json"}
        )
        assert r.status_code == 201, r.text
        c.delete(f"/sessions/{r.json()['session_id']}")


def test_sandbox_cmdline_hides_host_paths(server):
    with server.client() as http:
        sid = http.post("/sessions", json={"task_id": "fix-add"}).json()["session_id"]
        try:
            out = call(http, sid, "run_shell", command="cat /proc/1/cmdline /proc/1/environ | tr '\\0' ' '")
            text = out["result"]["stdout"]
            assert sid not in text and "composer-jax-env-" not in text and "/sessions/" not in text, text
            res = call(http, sid, "run_shell", command="exit 3")
            assert res["ok"] and res["result"]["exit_code"] == 3  # as docs/env_protocol.md says
        finally:
            http.delete(f"/sessions/{sid}")
