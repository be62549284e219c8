"""Yields you can compare (issue 41 item 3): `env mine --report FILE`'s summary and
`bench/env_mine.py --yields`, which runs the command per repository and tabulates its reports."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pytest
from support import minerepo
from support.live_server import requires_bwrap

from composer_jax.env.mining import miner as mine

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench"))
import env_mine  # noqa: E402


def test_summary_counts_candidates_and_commits_whose_tests_ran():
    """Worked by hand: 6 commits; 2 are rejected on their diff alone (not candidates); of the 4
    candidates, 1 never reached the sandbox (its patch did not apply), 3 ran their tests, 1 written."""
    outcomes = [
        mine.Outcome("a", "rejected", "root commit"),
        mine.Outcome("b", "rejected", "docs/config only"),
        mine.Outcome("c", "rejected", "patch does not apply"),
        mine.Outcome("d", "rejected", "no FAIL_TO_PASS", tests_run=True),
        mine.Outcome("e", "rejected", "environment did not build", tests_run=True),
        mine.Outcome("f", "written", task_id="x", tests_run=True),
    ]
    s = mine.summary("o/r", outcomes)
    assert (s["commits_seen"], s["candidates"], s["tests_run"], s["written"]) == (6, 4, 3, 1)
    assert list(s["rejected"]) == [
        "root commit",
        "docs/config only",
        "patch does not apply",
        "environment did not build",
        "no FAIL_TO_PASS",
    ]
    assert mine.format_summary(s).splitlines()[0] == (
        "o/r: 6 commits seen, 4 candidates, 3 run in the sandbox, 1 tasks written"
    )
    # the perturbed case: a rejection for a reason that is not about the diff is a candidate
    s = mine.summary("o/r", [mine.Outcome("g", "rejected", "too large"), mine.Outcome("h", "rejected", "flaky")])
    assert s["candidates"] == 1


def _yield(written: int, env_failed: int, wall: float, args: str = "--rev-range HEAD") -> dict:
    rejected = {"root commit": 1, **({"environment did not build": env_failed} if env_failed else {})}
    return {
        "repo": "o/r",
        "args": args,
        "commits_seen": 10,
        "candidates": 6,
        "tests_run": written + env_failed,
        "written": written,
        "rejected": rejected,
        "wall_seconds": wall,
        "newest": {"sha": "0123456789abcdef", "date": "2024-03-12T12:00:00Z"},
    }


def test_yield_tables_before_and_after():
    before, after = _yield(1, 4, 20.4), _yield(4, 1, 31.6)
    table = env_mine.yields_table([after]).splitlines()
    assert table[2] == (
        "| o/r (0123456, 2024-03-12) | `--rev-range HEAD` | 10 | 6 | 5 | 4 "
        "| root commit 1, environment did not build 1 | 32 s |"
    )
    other = _yield(2, 0, 5.0, args="--rev-range HEAD~3..HEAD")  # no run with these arguments before
    rows = env_mine.compare_table([before], [after, other]).splitlines()
    assert rows[2] == "| o/r | `--rev-range HEAD` | 5 / 5 | 1 / 4 | 4 / 1 | 20 s / 32 s | root commit 1 |"
    assert rows[3] == "| o/r | `--rev-range HEAD~3..HEAD` | - / 2 | - / 2 | - / 0 | - / 5 s | root commit 1 |"


def test_a_bad_repository_list_is_named(tmp_path):
    listing = tmp_path / "repos.toml"
    listing.write_text('args = ["--jobs", "1"]\n[[repo]]\nargs = ["--rev-range", "HEAD"]\n')
    args = argparse.Namespace(yields=str(listing), clones=None)
    with pytest.raises(SystemExit, match=r"repos.toml: \[\[repo\]\] 1 needs path"):
        env_mine.yield_runs(args, tmp_path)
    listing.write_text('[[repo]]\npath = "calc"\nargs = ["--rev-range", "HEAD~2..HEAD"]\n')
    args = argparse.Namespace(yields=str(listing), clones=tmp_path / "clones")
    assert env_mine.yield_runs(args, tmp_path) == [(tmp_path / "clones" / "calc", ["--rev-range", "HEAD~2..HEAD"])]


def _three_commits(repo: Path) -> str:
    repo.mkdir()
    minerepo.git(repo, "init", "-q", "-b", "main")
    minerepo.git(repo, "remote", "add", "origin", "https://github.com/example/calc.git")
    files = {"calc/__init__.py": "", "calc/ops.py": minerepo.OPS_V1, "tests/test_ops.py": minerepo.TEST_OPS_V1}
    minerepo.commit(repo, "Initial calc package", files, 1)
    fix = {"calc/ops.py": minerepo.OPS_V2, "tests/test_ops.py": minerepo.TEST_OPS_V2}
    minerepo.commit(repo, "Fix div: true division", fix, 2)
    return minerepo.commit(repo, "Docs: usage in the README", {"README.md": "usage\n"}, 3)


@requires_bwrap[0]
@requires_bwrap[1]
def test_yields_mode_runs_env_mine_and_reads_its_report(tmp_path, capsys, monkeypatch):
    """`--yields` on minerepo's first three commits (one run a side): a root commit, a task, a docs change."""
    head = _three_commits(tmp_path / "calc")
    out = tmp_path / "out"
    argv = ["--yields", "--repo", str(tmp_path / "calc"), "--out", str(out), "--runs", "1", "--quiet"]
    argv += ["--save", str(tmp_path / "y.json")]
    monkeypatch.setattr(sys, "argv", ["env_mine.py", *argv])
    assert env_mine.main() == 0
    report = json.loads((out / "calc.json").read_text())  # --report: where the bench asked
    assert not (out / "calc" / "mine_report.json").exists()
    assert (report["commits_seen"], report["candidates"], report["tests_run"], report["written"]) == (3, 1, 1, 1)
    assert report["rejected"] == {"root commit": 1, "docs/config only": 1}
    assert report["complete"] and report["wall_seconds"] > 0 and report["newest"]["sha"] == head
    assert report["options"]["runs"] == 1 and len(report["commits"]) == 3
    printed = capsys.readouterr().out
    assert "example/calc (" in printed and "3 commits, 1 candidates, 1 run in the sandbox, 1 tasks written" in printed
    saved = json.loads((tmp_path / "y.json").read_text())
    assert saved[0]["args"] == "--rev-range HEAD --jobs 2 --timeout 120 --runs 1" and "commits" not in saved[0]
    assert saved[0]["extra"] == ""
