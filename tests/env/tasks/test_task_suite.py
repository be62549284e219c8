"""The bundled task suite under tasks/: layout checks (fast) and oracle/untouched runs (sandbox)."""

from __future__ import annotations

import concurrent.futures
import pathlib
import re
import tomllib

import pytest
from support import harbor_oracle
from support.bwrap import needs_bwrap

from composer_jax.env.tasks.families.base import TEST_SH, VERIFIER_SOURCE

ROOT = pathlib.Path(__file__).resolve().parents[3]
TASKS = sorted(p for p in (ROOT / "tasks").iterdir() if p.is_dir()) if (ROOT / "tasks").is_dir() else []
KINDS_REQUIRED = {"debugging", "feature", "refactor", "tests", "docs", "devops", "optimization", "migration"}


def test_suite_size_and_spread():
    assert len(TASKS) >= 40
    cats = {tomllib.loads((t / "task.toml").read_text())["metadata"]["category"] for t in TASKS}
    assert KINDS_REQUIRED <= cats, KINDS_REQUIRED - cats


@pytest.mark.parametrize("task", TASKS, ids=[t.name for t in TASKS])
def test_task_layout(task):
    assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)*", task.name)
    meta = tomllib.loads((task / "task.toml").read_text())
    assert meta["version"] == "1.0"
    md = meta["metadata"]
    assert md["difficulty"] in {"easy", "medium", "hard"}
    assert md["author_name"] and md["category"] and isinstance(md["tags"], list) and md["tags"]
    assert meta["verifier"]["timeout_sec"] > 0 and meta["agent"]["timeout_sec"] > 0
    assert {"cpus", "memory_mb", "storage_mb"} <= set(meta["environment"])
    instruction = (task / "instruction.md").read_text()
    assert 40 <= len(instruction) <= 1500, len(instruction)
    assert (task / "environment" / "Dockerfile").read_text().startswith("FROM ")
    app_py = list((task / "environment" / "app").rglob("*.py"))
    assert len(app_py) >= 2, "workspace should be a small multi-file package"
    # the project's verifier (tasks/verifier.py, per-test verdicts), as written by `write_verifier`
    assert (task / "tests" / "test.sh").read_text() == TEST_SH
    assert (task / "tests" / "run_tests.py").read_text() == VERIFIER_SOURCE
    assert list((task / "tests").glob("test_*.py"))
    assert (task / "solution" / "solve.sh").is_file()
    for path in task.rglob("*"):
        if path.is_file() and path.suffix in {".py", ".sh", ".md", ".toml", ".txt", ".ini", ".cfg"}:
            text = path.read_text()
            assert "/work/" not in text and "/root/" not in text, f"machine path in {path}"


def test_suite_size_on_disk():
    total = sum(p.stat().st_size for p in (ROOT / "tasks").rglob("*") if p.is_file())
    assert total < 2_000_000, total


@pytest.mark.sandbox
@pytest.mark.slow
@needs_bwrap
def test_every_task_oracle_one_untouched_zero():
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        problems = [p for ps in pool.map(harbor_oracle.check_task, TASKS) for p in ps]
    assert not problems, "\n\n".join(problems)


SAMPLE = ["ratelimit-window-tests", "todo-ci-repair", "md-api-docs", "lru-recency-bug"]


@pytest.mark.sandbox
@needs_bwrap
@pytest.mark.parametrize("name", SAMPLE)
def test_sample_task_oracle_one_untouched_zero(name):
    """Fast tier: a few representative tasks (the slow test above covers them all)."""
    assert harbor_oracle.check_task(ROOT / "tasks" / name) == []
