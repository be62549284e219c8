"""`composer-jax env mine`: a git history built in the test, mined into validated tasks."""

from __future__ import annotations

import asyncio
import http.server
import json
import subprocess
import sys
import threading
import tomllib
from pathlib import Path

import pytest
from support import minerepo
from support.live_server import env_with_src, requires_bwrap

from composer_jax.cli import main as cli_main
from composer_jax.env.mining import miner as mine
from composer_jax.env.mining import statement as instruction
from composer_jax.env.mining.gitrepo import Commit, FileChange
from composer_jax.env.sandbox.runner import default_sandbox


def test_decide_reads_fail_to_pass_pass_to_pass_and_flaky():
    before = [{"t::a": {"outcome": "failed"}, "t::b": {"outcome": "passed"}, "t::f": {"outcome": "failed"}}] * 2
    after = [
        {
            "t::a": {"outcome": "passed"},
            "t::b": {"outcome": "passed"},
            "t::f": {"outcome": "passed"},
            "t::n": {"outcome": "passed"},
        },
        {
            "t::a": {"outcome": "passed"},
            "t::b": {"outcome": "passed"},
            "t::f": {"outcome": "failed"},
            "t::n": {"outcome": "passed"},
        },
    ]
    f2p, p2p, flaky = mine.decide(before, after)
    assert (f2p, p2p, flaky) == (["t::a", "t::n"], ["t::b"], ["t::f"])  # t::n was absent before: fail -> pass


def test_select_reasons():
    commit = Commit("c" * 40, "p" * 40, "2024-01-01T00:00:00Z", "s", "")
    opts = mine.MineOptions(max_files=3, max_changed_lines=50)

    def reason(*paths: str, lines: int = 2) -> str:
        changes = [FileChange(p, lines, 0, False, "M") for p in paths]
        try:
            mine.select(commit, changes, opts)
        except mine.Rejected as exc:
            return exc.reason
        return "candidate"

    assert reason("README.md") == "docs/config only"
    assert reason("pkg/a.py") == "no test change"
    assert reason("tests/test_a.py") == "no source change"
    assert reason("docs/x.rst", "tests/test_a.py") == "docs/config only"
    assert reason("pkg/a.py", "tests/test_a.py", lines=40) == "too large"
    assert reason("a.py", "b.py", "c.py", "tests/test_a.py") == "too large"
    assert reason("pkg/a.py", "tests/test_a.py") == "candidate"


def test_statement_never_holds_a_line_of_the_solution(tmp_path):
    patch = b"--- a/m.py\n+++ b/m.py\n@@ -1 +1 @@\n-    return a // b\n+    return float(a) / float(b)\n"
    leaky = "Division is wrong.\nThe fix: `return float(a) / float(b)` in m.py.\nExpected 0.5."
    assert instruction.without_leaks(leaky, patch) == "Division is wrong.\nExpected 0.5."

    # an OpenAI-compatible writer (a real HTTP server speaking the chat-completions shape)
    seen: list[dict] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            seen.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
            body = json.dumps({"choices": [{"message": {"role": "assistant", "content": leaky}}]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        writer = instruction.openai_writer(f"http://127.0.0.1:{srv.server_address[1]}/v1", "m")
        commit = Commit("c" * 40, "p" * 40, "2024-01-01T00:00:00Z", "Fix div", "")
        task = type("T", (), {"fail_to_pass": ["t.py::test_div"], "repo": "o/r", "solution_patch": patch})()
        text = instruction.write_instruction(
            commit, task, {"t.py::test_div": {"outcome": "failed", "message": "assert 0 == 0.5"}}, writer
        )
    finally:
        srv.shutdown()
    assert text == "Division is wrong.\nExpected 0.5."
    assert seen[0]["model"] == "m" and "assert 0 == 0.5" in seen[0]["messages"][1]["content"]


def _mine(repo: Path, out: Path, runs: int, env_cache=None) -> dict[str, mine.Outcome]:
    sandbox = default_sandbox()
    opts = mine.MineOptions(runs=runs, timeout_s=60.0, jobs=2, env_cache=env_cache)
    miner = mine.Miner(repo, out, sandbox, opts)
    outcomes = asyncio.run(miner.run())
    subjects = {o.sha: s for s, o in zip(_subjects(repo), outcomes, strict=True)}
    return {subjects[o.sha]: o for o in outcomes}


def _subjects(repo: Path) -> list[str]:
    return minerepo.git(repo, "log", "--first-parent", "--reverse", "--format=%s").splitlines()


def _check(outcomes: dict[str, mine.Outcome], out: Path, expected: dict[str, tuple]) -> None:
    assert set(outcomes) == set(expected)
    for subject, want in expected.items():
        got = outcomes[subject]
        if want[0] == "rejected":
            assert (got.status, got.reason) == ("rejected", want[1]), (subject, got)
            continue
        assert got.status == "written", (subject, got)
        assert (got.fail_to_pass, got.pass_to_pass) == (want[2], want[3]), subject
        meta = tomllib.loads((out / str(got.task_id) / "task.toml").read_text())["metadata"]
        assert (meta["category"], meta["fail_to_pass"], meta["pass_to_pass"]) == (want[1], want[2], want[3])
        assert meta["solution_commit"] == got.sha and meta["repo"] == "example/calc"
        statement = (out / str(got.task_id) / "instruction.md").read_text()
        for line in instruction.added_lines(_solution(out / str(got.task_id))):
            assert line not in statement


def _solution(task: Path) -> bytes:
    return (task / "solution" / "solution.patch").read_bytes()


def sandboxed(f):
    for mark in requires_bwrap:
        f = mark(f)
    return f


@sandboxed
def test_mine_two_commits(tmp_path):
    """The cheap sibling of the whole history: a bug fix with its test (one run a side) and a docs change."""
    repo = tmp_path / "calc"
    repo.mkdir()
    minerepo.git(repo, "init", "-q", "-b", "main")
    minerepo.git(repo, "remote", "add", "origin", "git@github.com:example/calc.git")
    minerepo.commit(
        repo,
        "Initial calc package",
        {"calc/__init__.py": "", "calc/ops.py": minerepo.OPS_V1, "tests/test_ops.py": minerepo.TEST_OPS_V1},
        1,
    )
    minerepo.commit(
        repo, "Fix div: true division", {"calc/ops.py": minerepo.OPS_V2, "tests/test_ops.py": minerepo.TEST_OPS_V2}, 2
    )
    minerepo.commit(repo, "Docs: usage in the README", {"README.md": "usage\n"}, 3)
    outcomes = _mine(repo, tmp_path / "out", runs=1)
    names = ("Initial calc package", "Fix div: true division", "Docs: usage in the README")
    _check(outcomes, tmp_path / "out", {k: minerepo.EXPECTED[k] for k in names})
    task = tmp_path / "out" / str(outcomes["Fix div: true division"].task_id)
    assert not (task / "environment" / "app" / ".git").exists()
    assert "a / b" not in (task / "environment" / "app" / "calc" / "ops.py").read_text()  # the parent commit
    assert "test_div" not in (task / "environment" / "app" / "tests" / "test_ops.py").read_text()  # no test patch


@pytest.mark.slow
@sandboxed
def test_mine_whole_history_and_validate(tmp_path):
    """Every commit of the calc history: exactly the expected tasks and rejections; `env validate` passes."""
    from composer_jax.env.sandbox.pyenv import EnvCache

    repo = tmp_path / "calc"
    minerepo.build(repo)
    wheels = minerepo.tinyfmt_wheelhouse(tmp_path / "wheelhouse")
    cache = EnvCache(tmp_path / "envs", default_sandbox(), wheelhouse=wheels)
    outcomes = _mine(repo, tmp_path / "out", runs=3, env_cache=cache)
    _check(outcomes, tmp_path / "out", minerepo.EXPECTED)
    fmt = tmp_path / "out" / str(outcomes["Show values with tinyfmt"].task_id)
    assert tomllib.loads((fmt / "task.toml").read_text())["environment"]["requirements"] == ["tinyfmt"]
    assert "RUN pip install --no-cache-dir tinyfmt" in (fmt / "environment" / "Dockerfile").read_text()
    # without a wheelhouse, the same commit's environment cannot be built: rejected with that reason
    alone = tmp_path / "alone"
    minerepo.git(tmp_path, "clone", "-q", str(repo), str(alone))
    last = mine.Miner(alone, tmp_path / "out2", default_sandbox(), mine.MineOptions(rev_range="HEAD~1..HEAD"))
    (outcome,) = asyncio.run(last.run())
    assert (outcome.status, outcome.reason) == ("rejected", "environment did not build"), outcome
    assert "tinyfmt" in outcome.detail
    validate = [
        "env",
        "validate",
        str(tmp_path / "out"),
        "--wheelhouse",
        str(wheels),
        "--env-cache",
        str(tmp_path / "envs"),
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "composer_jax.cli", *validate],
        capture_output=True,
        text=True,
        env=env_with_src(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("pass") >= 6


def test_cli_errors_name_the_bad_value(tmp_path, capsys):
    from composer_jax.env.mining.cli import mine_main

    assert cli_main(["env", "mine", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "is not a git checkout" in capsys.readouterr().err
    repo = tmp_path / "r"
    repo.mkdir()
    minerepo.git(repo, "init", "-q")
    assert cli_main(["env", "mine", str(repo), "--out", str(tmp_path / "o"), "--writer-url", "http://x/v1"]) == 2
    assert "--writer-url and --writer-model go together" in capsys.readouterr().err
    assert cli_main(["env", "mine", str(repo), "--out", str(tmp_path / "o"), "--rev-range", "nosuchref"]) == 2
    assert "--rev-range 'nosuchref'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        mine_main([str(repo), "--out", str(tmp_path / "o"), "--jobs", "0"])
    assert "--jobs" in capsys.readouterr().err
    assert (
        cli_main(
            [
                "env",
                "import-swebench",
                str(tmp_path / "none.jsonl"),
                "--repos",
                str(tmp_path),
                "--out",
                str(tmp_path / "o"),
            ]
        )
        == 2
    )
    assert "is not a file of instance records" in capsys.readouterr().err


def test_a_merge_commit_is_named_by_its_pull_request_title():
    merge = Commit(
        "c" * 40, "p" * 40, "2024-01-01T00:00:00Z", "Merge pull request #686 from lonnen/x", "add partial_product"
    )
    assert instruction.title_and_body(merge) == ("add partial_product", "")
    assert instruction.category_of(merge, [], {"t::a": {"outcome": "failed"}}, ["t::a"]) == "feature"
    plain = Commit("c" * 40, "p" * 40, "2024-01-01T00:00:00Z", "Merge branch 'stats'", "")
    assert instruction.title_and_body(plain) == ("Merge branch 'stats'", "")


def test_a_timed_out_run_before_the_change_decides_nothing():
    """A test the before-run never reported because it timed out is not FAIL_TO_PASS (it may hang
    rather than fail); one it did report as failing still is."""
    before = [{"t::reported": {"outcome": "failed"}, mine.TIMED_OUT: {"outcome": "timeout"}}]
    after = [{"t::reported": {"outcome": "passed"}, "t::unreported": {"outcome": "passed"}}]
    assert mine.decide(before, after) == (["t::reported"], [], [])
    assert mine.decide([{}], after) == (["t::reported", "t::unreported"], [], [])  # absent without a timeout


def test_max_tasks_is_exact_with_jobs_in_flight(tmp_path, monkeypatch):
    """Jobs that found tasks together write only max_tasks of them; one whose oracle fails frees
    its slot for the next."""
    repo = tmp_path / "r"
    repo.mkdir()
    minerepo.git(repo, "init", "-q", "-b", "main")
    written: list[str] = []

    def write_task(task, base, out):
        written.append(task)
        return out / task

    async def check_written(final, *args):
        await asyncio.sleep(0.01)  # the validation awaits: other jobs run meanwhile
        return "oracle failed" if final.name == "bad" else None

    monkeypatch.setattr(mine, "write_task", write_task)
    monkeypatch.setattr(mine.validate, "check_written", check_written)
    miner = mine.Miner(repo, tmp_path / "out", sandbox=None, opts=mine.MineOptions(max_tasks=2))

    async def one(name):
        try:
            return (await miner._write(name, None)).name
        except mine.Rejected as exc:
            return exc.reason
        except mine._Enough:
            return "enough"

    async def all_at_once():
        return await asyncio.gather(*(one(n) for n in ("bad", "a", "b", "c")))

    assert asyncio.run(all_at_once()) == ["oracle failed", "a", "enough", "enough"]
    assert (miner.written, miner.reserved) == (1, 1) and written == ["bad", "a"]
    assert asyncio.run(one("d")) == "d" and asyncio.run(one("e")) == "enough"


HANG_V1 = "def spin(n):\n    while n != 0:\n        pass\n    return n\n"
HANG_V2 = "def spin(n):\n    return 0\n"
TEST_HANG = "from calc.spin import spin\n\n\ndef test_spin():\n    assert spin(3) == 0\n"


@sandboxed
def test_mine_a_commit_whose_before_run_times_out(tmp_path):
    """The test hangs before the fix: the run before the change times out, so nothing is FAIL_TO_PASS."""
    repo = tmp_path / "calc"
    repo.mkdir()
    minerepo.git(repo, "init", "-q", "-b", "main")
    minerepo.git(repo, "remote", "add", "origin", "https://github.com/example/calc.git")
    minerepo.commit(repo, "Initial", {"calc/__init__.py": "", "calc/spin.py": HANG_V1, "tests/test_x.py": ""}, 1)
    minerepo.commit(repo, "Fix spin", {"calc/spin.py": HANG_V2, "tests/test_spin.py": TEST_HANG}, 2)
    opts = mine.MineOptions(runs=1, timeout_s=8.0, jobs=1)
    outcomes = asyncio.run(mine.Miner(repo, tmp_path / "out", default_sandbox(), opts).run())
    fix = outcomes[-1]
    assert (fix.status, fix.reason) == ("rejected", "no FAIL_TO_PASS"), fix
    assert "the run before the change timed out" in fix.detail


SOLUTION = b"""--- a/pkg/paths.py
+++ b/pkg/paths.py
@@ -1,2 +1,3 @@
 def clean(p):
-    return p
+    # strip the trailing slash
+    return normalize_path(p, sep="//")
"""
TEST_AFTER = """import re
import pytest
from pkg.paths import clean


def test_clean_message():
    with pytest.raises(ValueError, match="path must be relative"):
        clean("/abs")
"""
TEST_PATCH = b"""--- a/tests/test_paths.py
+++ b/tests/test_paths.py
@@ -6,3 +6,3 @@
 def test_clean_message():
-    with pytest.raises(ValueError, match="bad path"):
+    with pytest.raises(ValueError, match="path must be relative"):
         clean("/abs")
"""


def _instruction(tmp_path, message: str, body: str = "") -> str:
    files = tmp_path / "files"
    (files / "tests").mkdir(parents=True, exist_ok=True)
    (files / "tests" / "test_paths.py").write_text(TEST_AFTER)
    commit = Commit("c" * 40, "p" * 40, "2024-01-01T00:00:00Z", "Fix error message (#2246) close #2245", body)
    name = "tests/test_paths.py::test_clean_message"
    task = type(
        "T", (), {"fail_to_pass": [name], "repo": "o/r", "solution_patch": SOLUTION, "test_patch": TEST_PATCH}
    )()
    return instruction.write_instruction(commit, task, {name: {"outcome": "failed", "message": message}}, None, files)


def test_statement_drops_what_the_solution_introduces_unless_the_tests_show_it(tmp_path):
    """The commit's prose goes through the filter: a line naming an identifier or literal the
    solution adds is dropped; words it merely uses, and the tests' own names, stay."""
    assert instruction.solution_terms(SOLUTION) == {"normalize_path"}  # not the comment's words, not "//"
    body = "Paths are not cleaned.\nUse normalize_path in clean.\nThe trailing slash stays."
    text = _instruction(tmp_path, "Regex pattern did not match.", body)
    assert "Paths are not cleaned." in text and "The trailing slash stays." in text
    assert "normalize_path" not in text
    # a term the failing test shows itself may appear (here: the literal its assertion expects)
    assert instruction.without_leaks('Say "path must be relative".', TEST_PATCH, "") == ""  # not shown: a leak
    kept = instruction.without_leaks('Say "path must be relative".', TEST_PATCH, "match='path must be relative'")
    assert kept == 'Say "path must be relative".'


def test_statement_shows_the_changed_assertion_when_the_failure_hides_it(tmp_path):
    """'Regex pattern did not match' says nothing of the expected message: the statement shows the
    assertion line the test change gives the test; a message that shows the literal needs none."""
    hidden = _instruction(tmp_path, "Regex pattern did not match.")
    assert "What it now checks:" in hidden
    assert 'with pytest.raises(ValueError, match="path must be relative"):' in hidden
    told = _instruction(tmp_path, "Regex pattern did not match. Regex: 'path must be relative' Input: 'bad path'")
    assert "What it now checks:" not in told
