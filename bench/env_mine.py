"""Task mining throughput, and the grade time of a mined task next to a bundled one.

Mines a repository with `env mine`'s own code in this process (the sandbox is bubblewrap, as the
command's) and prints commits examined, candidates (commits that reached the sandbox), tasks
written, wall time and tasks written per minute at `--jobs`. Then grades, through the server's
grader (`grader.grade`, a fresh sandbox copy each time), one mined task's reference solution and
one bundled task's (`tasks/`), `--repeats` times each, and prints the median grade time of each.

    PYTHONPATH=src .venv/bin/python bench/env_mine.py [--repo PATH] [--jobs 2] [--repeats 5]

Without `--repo`, it mines the history `tests/support/minerepo.py` builds (11 first-parent commits,
5 tasks); with `--repo`, a local clone (`--rev-range` / `--since` narrow it).

Yields (`--yields`): runs the command itself, `composer-jax env mine`, on each repository and
prints, from each run's own report (`env mine --report`), the commits examined, candidates,
commits whose tests ran in the sandbox, tasks written, rejections by reason and wall time, then a
Markdown table for docs/tasks.md. `--save FILE` keeps the yields; `--before FILE` (an earlier
`--save`) adds a before/after table, row by row for the same repository and arguments
(`--mine-args` adds arguments to every run without renaming its row):

    PYTHONPATH=src .venv/bin/python bench/env_mine.py --yields REPOS.toml --out DIR [--save Y.json] [--before X.json]

REPOS.toml lists the repositories (paths under `--clones`, default the file's directory) and the
arguments `env mine` gets, `args` at the top level going to every run (bench/mine_yields.toml is the
list docs/tasks.md reports):

    args = ["--jobs", "2", "--timeout", "120"]
    [[repo]]
    path = "iniconfig"
    args = ["--rev-range", "HEAD"]

`--yields` without a file mines `--repo` (default: the minerepo history) with `--rev-range`,
`--since`, `--until`, `--jobs`, `--timeout`, `--runs`. Each run gets a fresh `--env-cache` under `--out`
(unless its arguments name one), so the environments it needs are built within its wall time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
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


def yield_runs(args: argparse.Namespace, work: Path) -> list[tuple[Path, list[str]]]:
    """(clone, `env mine` arguments) of each repository the yields are measured on."""
    if args.yields is None or args.yields == "-":
        repo = args.repo
        if repo is None:
            from support import minerepo

            repo = work / "calc"
            minerepo.build(repo, with_package=False)
        mine_args = ["--rev-range", args.rev_range, "--jobs", str(args.jobs), "--timeout", f"{args.timeout:g}"]
        mine_args += ["--runs", str(args.runs)] if args.runs != 3 else []
        mine_args += [a for flag, v in (("--since", args.since), ("--until", args.until)) if v for a in (flag, v)]
        return [(repo, mine_args)]
    listing = Path(args.yields)
    try:
        spec = tomllib.loads(listing.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SystemExit(f"--yields {listing}: not a readable TOML list of repositories ({exc})") from None
    common = [str(a) for a in spec.get("args", [])]
    clones = args.clones or listing.parent
    runs = []
    for i, entry in enumerate(spec.get("repo", [])):
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            raise SystemExit(f'--yields {listing}: [[repo]] {i + 1} needs path = "CLONE" (got {entry!r})')
        runs.append(((clones / entry["path"]).resolve(), common + [str(a) for a in entry.get("args", [])]))
    if not runs:
        raise SystemExit(f"--yields {listing}: lists no [[repo]] (each with a path and its `env mine` args)")
    return runs


def mine_yield(repo: Path, mine_args: list[str], out: Path, quiet: bool, extra: tuple[str, ...] = ()) -> dict:
    """`composer-jax env mine` run as a user runs it; its report (`--report`), with `args` (the
    run's own arguments, which name its row) and `extra` (those every run got, `--mine-args`) added."""
    report = out / f"{repo.name}.json"
    argv = ["env", "mine", str(repo), "--out", str(out / repo.name), "--report", str(report), *mine_args, *extra]
    if "--env-cache" not in mine_args + list(extra):
        argv += ["--env-cache", str(out / "envs" / repo.name)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    code = "import sys; from composer_jax.cli import main; sys.exit(main())"
    quiet_out = subprocess.DEVNULL if quiet else None
    proc = subprocess.run([sys.executable, "-c", code, *argv], env=env, stdout=quiet_out, stderr=quiet_out)
    if proc.returncode != 0 or not report.exists():
        raise SystemExit(f"env mine {repo} {' '.join(mine_args)} failed (exit {proc.returncode})")
    data = json.loads(report.read_text())
    data.pop("commits")
    return {**data, "args": " ".join(mine_args), "extra": " ".join(extra)}


def yield_key(y: dict) -> str:
    return f"{y['repo']} {y['args']}"


def _newest(y: dict) -> str:
    return f" ({y['newest']['sha'][:7]}, {y['newest']['date'][:10]})" if y.get("newest") else ""


def _rejected(rejected: dict[str, int]) -> str:
    return ", ".join(f"{reason} {n}" for reason, n in rejected.items()) or "none"


def yield_line(y: dict) -> str:
    return (
        f"{y['repo']}{_newest(y)} {y['args']}: {y['commits_seen']} commits, {y['candidates']} candidates, "
        f"{y['tests_run']} run in the sandbox, {y['written']} tasks written, {y['wall_seconds']:.0f} s\n"
        f"  rejected: {_rejected(y['rejected'])}"
    )


def yields_table(ys: list[dict]) -> str:
    """The Markdown table docs/tasks.md keeps, one row per run."""
    rows = [
        "| repository (newest commit) | `env mine` arguments | commits | candidates | tests run | written "
        "| rejected by reason | wall |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for y in ys:
        rows.append(
            f"| {y['repo']}{_newest(y)} | `{y['args']}` | {y['commits_seen']} | {y['candidates']} | {y['tests_run']} "
            f"| {y['written']} | {_rejected(y['rejected'])} | {y['wall_seconds']:.0f} s |"
        )
    return "\n".join(rows)


def compare_table(before: list[dict], after: list[dict]) -> str:
    """Before / after, row by row for the same repository and arguments (a run missing before: "-")."""
    old = {yield_key(y): y for y in before}
    env = "environment did not build"
    columns = {
        "tests run": lambda y: y["tests_run"],
        "written": lambda y: y["written"],
        env: lambda y: y["rejected"].get(env, 0),
        "wall": lambda y: f"{y['wall_seconds']:.0f} s",
    }
    rows = [
        "| repository | `env mine` arguments | "
        + " | ".join(f"{c} (before / after)" for c in columns)
        + " | other rejections (after) |",
        "| --- | --- | " + "--- | " * len(columns) + "--- |",
    ]
    for a in after:
        b = old.get(yield_key(a))
        pairs = [f"{get(b) if b else '-'} / {get(a)}" for get in columns.values()]
        other = _rejected({r: n for r, n in a["rejected"].items() if r != env})
        rows.append(f"| {a['repo']} | `{a['args']}` | " + " | ".join(pairs) + f" | {other} |")
    return "\n".join(rows)


def yields_main(args: argparse.Namespace) -> int:
    out = args.out or Path(tempfile.mkdtemp(prefix="bench-env-mine-yields-"))
    out.mkdir(parents=True, exist_ok=True)
    ys = []
    extra = tuple(shlex.split(args.mine_args or ""))
    for repo, mine_args in yield_runs(args, out):
        ys.append(mine_yield(repo, mine_args, out, args.quiet, extra))
        print(yield_line(ys[-1]), flush=True)
    print()
    print(yields_table(ys))
    if args.save:
        args.save.write_text(json.dumps(ys, indent=1) + "\n")
    if args.before:
        print()
        print(compare_table(json.loads(args.before.read_text()), ys))
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--repo", type=Path, help="a local git clone (default: the history tests/support/minerepo.py builds)"
    )
    p.add_argument("--rev-range", default="HEAD")
    p.add_argument("--since")
    p.add_argument("--until")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds for one test run (default 120)")
    p.add_argument("--runs", type=int, default=3, help="yields without a file: runs of each side (default 3)")
    p.add_argument("--yields", nargs="?", const="-", help="yields mode: a TOML list of repositories (or none: --repo)")
    p.add_argument("--out", type=Path, help="yields: where the tasks and reports go (default a fresh temp dir)")
    p.add_argument("--clones", type=Path, help="yields: the directory the TOML's paths are under (default its own)")
    p.add_argument(
        "--mine-args",
        help="yields: arguments every run gets besides its own, not part of its row's name "
        "(a pipeline option compared against a --before without it: --mine-args='--resolve-as-of commit')",
    )
    p.add_argument("--save", type=Path, help="yields: keep them in this JSON file")
    p.add_argument("--before", type=Path, help="yields: an earlier --save to compare with")
    p.add_argument("--quiet", action="store_true", help="yields: no per-commit lines from env mine")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--bundled", default="cron-day-or-weekday", help="the bundled task (under tasks/) to grade")
    args = p.parse_args()
    if args.yields is not None:
        return yields_main(args)

    from composer_jax.env.mining.miner import MineOptions, Miner, summary
    from composer_jax.env.sandbox.runner import default_sandbox

    work = Path(tempfile.mkdtemp(prefix="bench-env-mine-"))
    repo = args.repo
    if repo is None:
        from support import minerepo

        repo = work / "calc"
        minerepo.build(repo, with_package=False)
    opts = MineOptions(
        rev_range=args.rev_range, since=args.since, until=args.until, jobs=args.jobs, timeout_s=args.timeout
    )
    miner = Miner(repo, work / "out", default_sandbox(), opts)
    start = time.monotonic()
    outcomes = asyncio.run(miner.run())
    wall = time.monotonic() - start
    s = summary(miner.name, outcomes)
    print(f"{s['repo']}: {len(outcomes)} commits, {s['tests_run']} run in the sandbox, {s['written']} tasks written")
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
