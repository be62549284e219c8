"""A tiny mined-style task (`env.taskwrite.write_task`): a package with a bug, the test that shows
it (FAIL_TO_PASS) and one that already passes (PASS_TO_PASS), so the evaluation, SFT and RL tests
of repository tasks do not depend on the miner."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

from composer_jax.env.mining.taskwrite import RepoTask, write_task

BASE = {
    "pkg/__init__.py": "",
    "pkg/calc.py": "def add(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n",
    "tests/test_mul.py": "from pkg.calc import mul\n\n\ndef test_mul():\n    assert mul(2, 3) == 6\n",
}
TEST_FILE = "tests/test_add.py", "from pkg.calc import add\n\n\ndef test_add():\n    assert add(2, 3) == 5\n"
FIX = {"pkg/calc.py": BASE["pkg/calc.py"].replace("a - b", "a + b"), "pkg/NOTES.txt": "add: fixed\n"}


def _git(cwd: Path, *args: str) -> bytes:
    env = {
        **os.environ,
        "GIT_CEILING_DIRECTORIES": str(cwd.parent),
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@t",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@t",
    }
    return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True).stdout


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)


def repo_task(
    tmp: Path,
    out_root: Path,
    *,
    name: str = "acme-calc-1",
    repo: str = "acme/calc",
    category: str = "bug fix",
    instance_id: str | None = None,
    extra_fix: dict[str, bytes] | None = None,
    source: str = "mined",
) -> Path:
    """Write the task under out_root/name and return its directory."""
    src = tmp / f"src-{name}"
    _write(src, BASE)
    _git(src, "init", "-q")
    _git(src, "add", "-A")
    _git(src, "commit", "-qm", "base")
    base = _git(src, "rev-parse", "HEAD").decode().strip()
    _write(src, dict([TEST_FILE]))
    _git(src, "add", "-A")
    test_patch = _git(src, "diff", "--cached", "--binary")
    _git(src, "reset", "-q", "--hard")
    _write(src, FIX)
    for rel, data in (extra_fix or {}).items():
        (src / rel).write_bytes(data)
    _git(src, "add", "-A")
    solution_patch = _git(src, "diff", "--cached", "--binary")
    _git(src, "reset", "-q", "--hard")
    base_tree = tmp / f"base-{name}"
    shutil.copytree(src, base_tree, ignore=shutil.ignore_patterns(".git"))
    task = RepoTask(
        task_id=name,
        instance_id=instance_id or name,
        repo=repo,
        base_commit=base,
        commit_date="2026-01-01T00:00:00Z",
        category=category,
        instruction="`pkg.calc.add` subtracts instead of adding. Make `add(2, 3)` return 5.",
        test_patch=test_patch,
        solution_patch=solution_patch,
        test_files=["tests/test_add.py", "tests/test_mul.py"],
        fail_to_pass=["tests/test_add.py::test_add"],
        pass_to_pass=["tests/test_mul.py::test_mul"],
        verifier_timeout_s=60.0,
        source=source,
    )
    return write_task(task, base_tree, out_root)
