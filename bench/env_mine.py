"""Task mining throughput, and the grade time of a mined task next to a bundled one.

Mines a repository with `env mine`'s own code in this process (the sandbox is bubblewrap, as the
command's) and prints commits examined, candidates (commits that reached the sandbox), tasks
written, wall time and tasks written per minute at `--jobs`. Then grades, through the server's
grader (`grader.grade`, a fresh sandbox copy each time), one mined task's reference solution and
one bundled task's (`tasks/`), `--repeats` times each, and prints the median grade time of each.

    PYTHONPATH=src .venv/bin/python bench/env_mine.py [--repo PATH] [--jobs 2] [--repeats 5]

Without `--repo`, it mines the history `tests/support/minerepo.py` builds (11 first-parent commits,
5 tasks); with `--repo`, a local clone (`--rev-range` / `--since` narrow it).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the test helpers: `support.minerepo`


async def grade_times(task_root: Path, repeats: int) -> list[float]:
    from composer_jax.env.sandbox.runner import Limits, default_sandbox
    from composer_jax.env.tasks import grader
    from composer_jax.env.tasks.store import load_task

    task = load_task(task_root)
    sandbox = default_sandbox()
    limits = Limits(wall_seconds=300, cpu_seconds=301, memory_mb=4096)
    scratch = Path(tempfile.mkdtemp(prefix="bench-env-mine-"))
    times = []
    for i in range(repeats):
        lease = sandbox.lease(f"bench-{i}-{time.monotonic_ns()}")
        try:
            solved, _ = await grader.oracle_workspace(task, lease, scratch, limits)
            try:
                start = time.monotonic()
                result = await grader.grade(task, lease, solved, scratch, limits)
                times.append(time.monotonic() - start)
            finally:
                grader.release_job(solved)
            assert result.reward == 1.0, (task_root.name, result.error, result.output_tail[-500:])
        finally:
            await lease.close()
    return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--repo", type=Path, help="a local git clone (default: the history tests/support/minerepo.py builds)"
    )
    p.add_argument("--rev-range", default="HEAD")
    p.add_argument("--since")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bundled", default="cron-day-or-weekday", help="the bundled task (under tasks/) to grade")
    args = p.parse_args()

    from composer_jax.env.mining.miner import MineOptions, Miner, summary
    from composer_jax.env.sandbox.runner import default_sandbox

    work = Path(tempfile.mkdtemp(prefix="bench-env-mine-"))
    repo = args.repo
    if repo is None:
        from support import minerepo

        repo = work / "calc"
        minerepo.build(repo, with_package=False)
    opts = MineOptions(rev_range=args.rev_range, since=args.since, jobs=args.jobs, timeout_s=120.0)
    miner = Miner(repo, work / "out", default_sandbox(), opts)
    start = time.monotonic()
    outcomes = asyncio.run(miner.run())
    wall = time.monotonic() - start
    s = summary(miner.name, outcomes)
    early = {"root commit", "no test change", "no source change", "docs/config only", "too large", "no test module"}
    candidates = sum(1 for o in outcomes if o.status == "written" or o.reason not in early)
    sandboxed = f"{candidates} run in the sandbox"
    print(f"{s['repo']}: {len(outcomes)} commits, {sandboxed}, {s['written']} tasks written")
    print(f"  wall {wall:.1f} s at --jobs {args.jobs}: {60 * s['written'] / wall:.1f} tasks/min")
    print(f"  rejected: {s['rejected']}")
    written = sorted(p for p in (work / "out").iterdir() if p.is_dir())
    if not written:
        print("no task written; nothing to grade")
        return 1
    bundled = ROOT / "tasks" / args.bundled
    for label, root in (("mined", written[0]), ("bundled", bundled)):
        times = asyncio.run(grade_times(root, args.repeats))
        print(f"  grade of a {label} task ({root.name}): median {statistics.median(times):.2f} s over {len(times)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
