"""What a grade costs, before and after a change to grading, measured side by side in one run (issue 49).

    PYTHONPATH=src .venv/bin/python bench/grade_cost.py                 # before = d968e98
    PYTHONPATH=src .venv/bin/python bench/grade_cost.py --before REV --rounds 6

The revision REV is checked out into a temporary git worktree. Each side runs in a worker process of
its own (`--worker SRC`, the side's sources first on PYTHONPATH) that builds its own copy of two
tasks with its own code: the bundled `lru-recency-bug` (its tests/ as that revision wrote them) and
a mined-style repository task (the tests' `repo_task`), then grades each, untouched and with the
reference fix, through the bubblewrap backend: one warm-up grade, then `--rounds` timed grades
each (wall time around `grader.grade`). The two sides' workers alternate, round robin, so load
drifts hit both. It prints one row per (task, state) with each side's median and the ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _first(*names: str):
    """The first of these modules that imports (the layout moved between revisions)."""
    for name in names:
        try:
            return importlib.import_module(name)
        except ImportError:
            continue
    raise ImportError(f"none of {names} imports")


def worker(tree: Path, rounds: int, scratch: Path) -> dict:
    """Grade the two tasks with the sources of `tree` (already first on sys.path); -> {label: [s]}."""
    sys.path.insert(0, str(tree / "tests"))
    grader = _first("composer_jax.env.tasks.grader", "composer_jax.env.grader")
    runner = _first("composer_jax.env.sandbox.runner", "composer_jax.env.sandbox")
    store = _first("composer_jax.env.tasks.store", "composer_jax.env.tasks")
    repo_tasks = _first("support.repo_tasks", "rl.repo_tasks")
    tasks_dir = scratch / "tasks"
    shutil.copytree(tree / "tasks" / "lru-recency-bug", tasks_dir / "bundled")
    repo_tasks.repo_task(scratch, tasks_dir, name="mined")
    fixes = {
        "bundled": {"lru/core.py": (tree / "tasks/lru-recency-bug/solution/app/lru/core.py").read_text()},
        "mined": dict(repo_tasks.FIX),
    }
    sandbox = runner.BubblewrapSandbox()
    work = scratch / "work"
    work.mkdir()
    times: dict[str, list[float]] = {}

    async def one(kind: str, fixed: bool) -> float:
        task = store.load_task(tasks_dir / kind)
        app = Path(tempfile.mkdtemp(dir=scratch))
        shutil.copytree(task.app_dir, app, dirs_exist_ok=True)
        for rel, text in (fixes[kind] if fixed else {}).items():
            (app / rel).parent.mkdir(parents=True, exist_ok=True)
            (app / rel).write_text(text)
        app.chmod(0o755)
        lease = sandbox.lease(f"bench-{kind}")
        try:
            start = time.perf_counter()
            g = await grader.grade(task, lease, app, work, runner.Limits(wall_seconds=120))
            elapsed = time.perf_counter() - start
        finally:
            await lease.close()
            shutil.rmtree(app, ignore_errors=True)
        if g.reward != (1.0 if fixed else 0.0):
            raise RuntimeError(f"{kind} fixed={fixed}: reward {g.reward} ({g.error})")
        return elapsed

    for r in range(rounds + 1):
        for kind in ("bundled", "mined"):
            for fixed in (False, True):
                elapsed = asyncio.run(one(kind, fixed))
                if r:  # round 0 warms the sandbox and the page cache
                    times.setdefault(f"{kind} {'fixed' if fixed else 'untouched'}", []).append(elapsed)
    return times


def spawn(label: str, tree: Path, rounds: int) -> dict:
    scratch = Path(tempfile.mkdtemp(prefix=f"grade-cost-{label}-"))
    try:
        env = {**os.environ, "PYTHONPATH": str(tree / "src")}
        argv = [sys.executable, __file__, "--worker", str(tree), "--rounds", str(rounds), "--scratch", str(scratch)]
        out = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"{label} worker failed:\n{out.stderr[-3000:]}")
        return json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", default="d968e98", help="the revision to compare with (default: %(default)s)")
    p.add_argument("--rounds", type=int, default=4, help="timed grades per task and state, per worker run")
    p.add_argument("--repeats", type=int, default=2, help="worker runs per side, alternating")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--scratch", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker is not None:
        print(json.dumps(worker(args.worker, args.rounds, args.scratch)))
        return
    before_tree = Path(tempfile.mkdtemp(prefix="grade-cost-before-")) / "tree"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(before_tree), args.before], check=True
    )
    try:
        sides = {"before": before_tree, "after": ROOT}
        merged: dict[str, dict[str, list[float]]] = {s: {} for s in sides}
        for _ in range(args.repeats):
            for side, tree in sides.items():
                for label, values in spawn(side, tree, args.rounds).items():
                    merged[side].setdefault(label, []).extend(values)
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before_tree)], check=False)
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")  # fmt: skip
    print(f"grade wall time, median of {args.rounds * args.repeats} per cell; {os.cpu_count()} cores, {cpu}")
    print(f"before = {args.before}, after = the working tree")
    print("| task | before (s) | after (s) | after / before |\n|---|---|---|---|")
    for label in merged["after"]:
        b, a = statistics.median(merged["before"][label]), statistics.median(merged["after"][label])
        print(f"| {label} | {b:.2f} | {a:.2f} | {a / b:.2f} |")


if __name__ == "__main__":
    main()
