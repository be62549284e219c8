"""`composer-jax env mine REPO --out DIR` and `composer-jax env import-swebench INSTANCES --repos DIR --out DIR`.

Both print one line per commit or instance as it is decided, then a summary table (seen, written,
rejected by reason), and keep the same figures in OUT/mine_report.json / OUT/import_report.json
(`env mine --report FILE` puts its report elsewhere: `bench/env_mine.py --yields` reads it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from composer_jax.env.mining import projectenv
from composer_jax.env.sandbox.factory import add_env_cache_flags
from composer_jax.errors import UsageError
from composer_jax.flags import int_at_least

_positive = int_at_least(1)


def mine_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="composer-jax env mine",
        description="Mine a git repository's first-parent history into validated Harbor tasks "
        "(FAIL_TO_PASS / PASS_TO_PASS found by running the tests before and after each commit, in the sandbox).",
    )
    p.add_argument("repo", type=Path, help="a local git checkout of a Python project tested with pytest")
    p.add_argument("--out", type=Path, required=True, help="directory the tasks are written under")
    p.add_argument("--rev-range", default="HEAD", help="commits to examine, as `git log` takes them (default HEAD)")
    p.add_argument("--since", help="only commits after this date (git's --since: 2024-01-01, '2 years ago')")
    p.add_argument("--until", help="only commits before this date")
    p.add_argument("--max-tasks", type=_positive, help="stop after writing this many tasks")
    p.add_argument("--jobs", type=_positive, default=2, help="commits mined in parallel (default 2)")
    p.add_argument("--max-files", type=_positive, default=15, help="largest change in files (default 15)")
    p.add_argument("--max-changed-lines", type=_positive, default=1000, help="largest change in lines (default 1000)")
    p.add_argument("--runs", type=_positive, default=3, help="runs of each side, to find flaky tests (default 3)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for one test run (default 300)")
    p.add_argument("--writer-url", help="an OpenAI-compatible base URL (…/v1) that writes the problem statements")
    p.add_argument("--writer-model", help="the model name for --writer-url")
    p.add_argument("--writer-api-key-env", default="OPENAI_API_KEY", help="environment variable holding its key")
    p.add_argument("--unsafe-no-sandbox", action="store_true", help="run without bubblewrap (NO isolation)")
    p.add_argument(
        "--report",
        type=Path,
        help="write the JSON report here (default OUT/mine_report.json): the summary, wall_seconds, "
        "the options and every commit's outcome",
    )
    add_env_cache_flags(p)
    projectenv.add_resolve_flag(p)
    return p


def _mine_options(args):
    """`env mine`'s arguments checked, and the miner's options and the commits it decides."""
    import os

    from composer_jax.env.mining import gitrepo
    from composer_jax.env.mining.miner import MineOptions
    from composer_jax.env.mining.statement import openai_writer
    from composer_jax.env.sandbox.factory import make_env_cache, make_sandbox

    if not (args.repo / ".git").exists():
        raise UsageError(f"{args.repo} is not a git checkout (no .git); give a local clone of the repository")
    if args.timeout <= 0:
        raise UsageError(f"--timeout {args.timeout:g} must be > 0 seconds")
    if bool(args.writer_url) != bool(args.writer_model):
        raise UsageError("--writer-url and --writer-model go together (got only one)")
    writer = None
    if args.writer_url:
        writer = openai_writer(args.writer_url, args.writer_model, os.environ.get(args.writer_api_key_env))
    try:
        commits = gitrepo.first_parent_commits(args.repo, args.rev_range, args.since, args.until)
    except gitrepo.GitError as exc:
        raise UsageError(f"cannot list commits of {args.repo} (--rev-range {args.rev_range!r}): {exc}") from exc
    sandbox = make_sandbox(args.unsafe_no_sandbox, args.timeout)
    opts = MineOptions(
        env_cache=None if args.unsafe_no_sandbox else make_env_cache(args, sandbox),
        rev_range=args.rev_range,
        since=args.since,
        until=args.until,
        max_tasks=args.max_tasks,
        jobs=args.jobs,
        max_files=args.max_files,
        max_changed_lines=args.max_changed_lines,
        runs=args.runs,
        timeout_s=args.timeout,
        writer=writer,
        dated=projectenv.dated(args),
    )
    return sandbox, opts, commits


def _report_header(args, commits: list) -> dict:
    """What a report says about the run itself: what was asked for and the newest commit examined."""
    newest = commits[-1] if commits else None
    return {
        "options": {
            "rev_range": args.rev_range,
            "since": args.since,
            "until": args.until,
            "max_tasks": args.max_tasks,
            "jobs": args.jobs,
            "runs": args.runs,
            "timeout": args.timeout,
        },
        "newest": {"sha": newest.sha, "date": newest.date} if newest else None,
    }


def mine_main(argv: list[str]) -> int:
    from composer_jax.env.mining.miner import Miner, format_summary, summary

    args = mine_parser().parse_args(argv)
    sandbox, opts, commits = _mine_options(args)
    done: list = []
    miner = Miner(args.repo, args.out, sandbox, opts)
    report_path = args.report or args.out / "mine_report.json"
    header = _report_header(args, commits)
    start = time.monotonic()

    def write_report(outcomes: list, complete: bool) -> dict:
        s = summary(miner.name, outcomes)
        s["package_source_problems"] = dict(getattr(opts.env_cache, "source_problems", {}))
        wall = round(time.monotonic() - start, 2)
        report = {**s, "complete": complete, "wall_seconds": wall, **header}
        report["commits"] = [o.__dict__ for o in outcomes]
        report_path.parent.mkdir(parents=True, exist_ok=True)
        report_path.write_text(json.dumps(report, indent=1) + "\n")
        return s

    def progress(o) -> None:
        what = o.task_id if o.status == "written" else f"{o.reason}: {o.detail[:120]}"
        print(f"  {o.sha[:10]} {o.status:<8} {what} ({o.seconds:g}s)", file=sys.stderr, flush=True)
        done.append(o)
        write_report(done, complete=False)  # an interrupted run keeps what it decided

    miner.progress = progress
    prog = "composer-jax env mine"
    print(f"{prog}: {len(commits)} first-parent commits in {args.repo}", file=sys.stderr)
    try:
        outcomes = asyncio.run(miner.run(commits))
    except KeyboardInterrupt:
        print(f"{prog}: interrupted; {len(done)} commits decided, kept in {report_path}")
        print(format_summary(write_report(done, complete=False)))
        return 130
    print(format_summary(write_report(outcomes, complete=True)))
    return 0


def env_subcommand(argv: list[str]) -> int:
    if argv[0] == "mine":
        return mine_main(argv[1:])
    from composer_jax.env.mining.swebench_import import import_main

    return import_main(argv[1:])
