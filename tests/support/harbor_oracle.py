"""A small, self-contained runner for Harbor-format tasks under bubblewrap (stdlib only).

It runs a task exactly per the task contract:
  * the workspace is a fresh copy of ``environment/app`` mounted read-write at ``/app``;
  * ``solution/solve.sh`` (oracle runs only) runs with cwd ``/app`` and ``/solution`` read-only;
  * ``tests/test.sh`` runs with cwd ``/app``, ``/tests`` read-only and ``/logs`` writable, and must
    leave ``/logs/verifier/reward.txt``.
Everything else is a read-only view of the host's system directories and Python installation,
with no network and a private /tmp.

    reward = run_task(task_dir, oracle=True)    # 1.0 expected
    reward = run_task(task_dir, oracle=False)   # 0.0 expected
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

BWRAP = shutil.which("bwrap")


@dataclasses.dataclass
class RunResult:
    reward: float | None
    solve_rc: int | None
    test_rc: int
    output: str


def _prefixes() -> list[str]:
    out: list[str] = []
    for p in (sys.base_prefix, sys.prefix, os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)):
        if p not in out and not any(p == q for q in out):
            out.append(p)
    return out


def _bwrap_cmd(work: pathlib.Path, task: pathlib.Path, logs: pathlib.Path, script: str) -> list[str]:
    cmd = [BWRAP or "bwrap", "--die-with-parent", "--unshare-net", "--unshare-pid", "--unshare-ipc", "--tmpfs", "/"]
    for d in ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc"):
        if os.path.exists(d):
            cmd += ["--ro-bind", d, d]
    # the private /tmp comes before the interpreter binds: a checkout (and its venv) under /tmp
    # must stay visible inside the sandbox
    cmd += ["--tmpfs", "/tmp"]
    for p in _prefixes():
        cmd += ["--ro-bind", p, p]
    cmd += [
        "--bind",
        str(work),
        "/app",
        "--ro-bind",
        str(task / "tests"),
        "/tests",
        "--bind",
        str(logs),
        "/logs",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--chdir",
        "/app",
        "--clearenv",
        "--setenv",
        "PATH",
        f"{os.path.dirname(sys.executable)}:/usr/local/bin:/usr/bin:/bin",
        "--setenv",
        "HOME",
        "/tmp",
        "--setenv",
        "LANG",
        "C.UTF-8",
        # the host venv may carry heavy pytest plugins; tasks need none (same as the env server)
        "--setenv",
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD",
        "1",
    ]
    if (task / "solution").is_dir():
        cmd += ["--ro-bind", str(task / "solution"), "/solution"]
    return cmd + ["bash", script]


def run_task(task_dir: str | os.PathLike, oracle: bool, timeout: float = 120.0) -> RunResult:
    """Run one task (after its reference solution when ``oracle``) and return the verifier's reward."""
    if BWRAP is None:
        raise RuntimeError("bubblewrap (bwrap) is not installed")
    task = pathlib.Path(task_dir).resolve()
    with tempfile.TemporaryDirectory(prefix="harbor-oracle-") as tmp:
        work = pathlib.Path(tmp) / "app"
        logs = pathlib.Path(tmp) / "logs"
        shutil.copytree(task / "environment" / "app", work, symlinks=True)
        (logs / "verifier").mkdir(parents=True)
        output = []
        solve_rc = None
        if oracle:
            p = subprocess.run(
                _bwrap_cmd(work, task, logs, "/solution/solve.sh"), capture_output=True, text=True, timeout=timeout
            )
            solve_rc = p.returncode
            output.append(f"--- solve.sh rc={p.returncode}\n{p.stdout}{p.stderr}")
        p = subprocess.run(
            _bwrap_cmd(work, task, logs, "/tests/test.sh"), capture_output=True, text=True, timeout=timeout
        )
        output.append(f"--- test.sh rc={p.returncode}\n{p.stdout}{p.stderr}")
        reward_file = logs / "verifier" / "reward.txt"
        reward = None
        if reward_file.exists():
            try:
                reward = float(reward_file.read_text().strip())
            except ValueError:
                reward = None
        return RunResult(reward=reward, solve_rc=solve_rc, test_rc=p.returncode, output="".join(output))


def check_task(task_dir: str | os.PathLike) -> list[str]:
    """Problems with a task: [] when the oracle scores 1 and the untouched workspace scores 0."""
    problems = []
    ok = run_task(task_dir, oracle=True)
    if ok.reward != 1.0:
        problems.append(f"{task_dir}: oracle reward {ok.reward} (expected 1)\n{ok.output[-3000:]}")
    bad = run_task(task_dir, oracle=False)
    if bad.reward != 0.0:
        problems.append(f"{task_dir}: untouched reward {bad.reward} (expected 0)\n{bad.output[-3000:]}")
    return problems


def main(argv: list[str] | None = None) -> int:
    """``python tests/support/harbor_oracle.py TASK_DIR...``: check each task, print a line per task."""
    import concurrent.futures

    argv = sys.argv[1:] if argv is None else argv
    dirs = []
    for a in argv:
        p = pathlib.Path(a)
        dirs += sorted(q for q in p.iterdir() if (q / "task.toml").exists()) if not (p / "task.toml").exists() else [p]
    failed = 0
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        for d, problems in zip(dirs, pool.map(check_task, dirs)):
            print(("ok   " if not problems else "FAIL ") + d.name, flush=True)
            for pr in problems:
                print(pr)
            failed += bool(problems)
    print(f"{len(dirs) - failed}/{len(dirs)} tasks ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
