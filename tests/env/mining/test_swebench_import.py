"""`composer-jax env import-swebench`, and the grade's per-test report against the `swebench` package's grading."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import pytest
from support import minerepo
from support.bwrap import needs_bwrap
from support.live_server import env_with_src

from composer_jax.env.mining import swebench_import
from composer_jax.env.mining.taskwrite import write_task
from composer_jax.env.sandbox.runner import default_sandbox
from composer_jax.env.tasks import verifier as swe_runner

SWEBENCH = Path(sys.prefix) / "swebench"  # `make venv` installs the pinned package there (--no-deps)

TEST_RICH = """\
import pytest

from calc import ops


def test_sub():
    assert ops.sub(5, 3) == 2


@pytest.mark.parametrize("a,b", [(1, 1), (2, 0)])
def test_sub_param(a, b):
    assert ops.sub(a, b) == a - b


class TestSub:
    def test_neg(self):
        assert ops.sub(0, 1) == -1


@pytest.mark.skip(reason="not today")
def test_skipped():
    pass


@pytest.mark.xfail(reason="known")
def test_xfail():
    assert ops.sub(1, 1) == 1


@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")


def test_error(broken):
    pass


def test_add_still():
    assert ops.add(1, 1) == 2
"""
F2P = [
    "tests/test_rich.py::test_sub",
    "tests/test_rich.py::test_sub_param[1-1]",
    "tests/test_rich.py::test_sub_param[2-0]",
    "tests/test_rich.py::TestSub::test_neg",
    "tests/test_rich.py::test_xfail",
]
P2P = ["tests/test_add_still_absent.py::test_nothing", "tests/test_rich.py::test_add_still"]
P2P += ["tests/test_rich.py::test_skipped", "tests/test_rich.py::test_error"]


def swebench_grading():
    """`swebench.harness.grading` and `log_parsers.python`, loaded without `swebench.harness/__init__`
    (which imports docker and datasets; the grading functions need neither)."""
    if not (SWEBENCH / "swebench").is_dir():
        pytest.skip(f"the swebench package is not installed in {SWEBENCH} (`make venv`)")
    sys.path.insert(0, str(SWEBENCH))
    spec = importlib.util.find_spec("swebench")
    assert spec is not None and spec.submodule_search_locations
    harness = types.ModuleType("swebench.harness")
    harness.__path__ = [str(Path(spec.submodule_search_locations[0]) / "harness")]
    sys.modules.setdefault("swebench.harness", harness)
    from swebench.harness import grading
    from swebench.harness.log_parsers import python as parsers

    return grading, parsers


@pytest.fixture(scope="module")
def calc(tmp_path_factory) -> tuple[Path, dict[str, str]]:
    root = tmp_path_factory.mktemp("repos")
    repo = root / "example__calc"
    shas = minerepo.build(repo, with_package=False)
    # the "rich" instance: a patch adding `sub` and a test patch of every pytest outcome
    minerepo.git(repo, "checkout", "-q", "-b", "rich")
    minerepo.commit(
        repo, "sub", {"calc/ops.py": (repo / "calc/ops.py").read_text() + "\n\ndef sub(a, b):\n    return a - b\n"}, 20
    )
    minerepo.commit(repo, "sub tests", {"tests/test_rich.py": TEST_RICH}, 20)
    minerepo.git(repo, "checkout", "-q", "main")
    return repo, shas


def record(
    repo: Path, iid: str, base: str, src: str, tests: str, f2p: list[str], p2p: list[str], as_json: bool
) -> dict:
    def diff(a: str, b: str, *paths: str) -> str:
        return minerepo.git(repo, "diff", "--no-renames", "--binary", a, b, "--", *paths)

    lists: dict = {"FAIL_TO_PASS": json.dumps(f2p), "PASS_TO_PASS": json.dumps(p2p)} if as_json else {}
    return {
        "instance_id": iid,
        "repo": "example/calc",
        "base_commit": base,
        "patch": diff(base, src, "calc"),
        "test_patch": diff(base, tests, "tests"),
        "problem_statement": f"Issue {iid}\n\nSomething is wrong.",
        "FAIL_TO_PASS": f2p,
        "PASS_TO_PASS": p2p,
        "version": "0.1",
        "environment_setup_commit": base,
        "created_at": "2024-03-20T00:00:00Z",
        **lists,
    }


def run_verifier(task: Path, app_src: Path, tmp: Path, patch: str | None) -> tuple[dict, str, str]:
    """(report.json, the log between SWE-bench's markers, reward) of the task's verifier on a copy of `app_src`."""
    app, logs = tmp / "app", tmp / "logs"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(app_src, app)
    if patch:
        subprocess.run(["git", "apply", "-"], cwd=app, input=patch.encode(), check=True)
    argv = [sys.executable, str(task / "tests" / "run_tests.py"), "--app", str(app), "--tests", str(task / "tests")]
    subprocess.run([*argv, "--logs", str(logs)], check=True, capture_output=True)
    log = (logs / "test_output.txt").read_text()
    body = log.split(swe_runner.START, 1)[1].split(swe_runner.END, 1)[0]
    return json.loads((logs / "report.json").read_text()), body, (logs / "reward.txt").read_text().strip()


def test_grade_report_equals_swebench_grading(calc, tmp_path):
    grading, parsers = swebench_grading()
    repo, _ = calc
    base = minerepo.git(repo, "rev-parse", "main").strip()
    rec = record(repo, "example__calc-rich", base, "rich~1", "rich", F2P, P2P, as_json=True)
    task_def, tree = swebench_import.to_task(rec, repo.parent, tmp_path / "work")
    task = write_task(task_def, tree, tmp_path / "tasks")
    wrong = rec["patch"].replace("return a - b", "return abs(a - b)")
    gold = {"FAIL_TO_PASS": F2P, "PASS_TO_PASS": P2P}
    seen = set()
    for label, patch in (("untouched", None), ("gold", rec["patch"]), ("wrong", wrong)):
        ours, log, reward = run_verifier(task, task / "environment" / "app", tmp_path / label, patch)
        status = parsers.parse_log_pytest(log, None)
        theirs = grading.get_eval_tests_report(status, gold)
        assert ours == theirs, label
        resolved = grading.get_resolution_status(theirs) == "RESOLVED_FULL"
        assert reward == ("1" if resolved else "0"), label
        seen.add(json.dumps(ours["FAIL_TO_PASS"]))
    assert len(seen) == 3  # three different reports: the comparison is not of empty lists


def test_grade_resolves_when_all_listed_tests_pass(calc, tmp_path):
    """The SWE-bench rule end to end on the verifier: the gold patch resolves when P2P holds no bad test."""
    grading, parsers = swebench_grading()
    repo, _ = calc
    base = minerepo.git(repo, "rev-parse", "main").strip()
    p2p = ["tests/test_rich.py::test_add_still"]
    rec = record(repo, "calc-ok", base, "rich~1", "rich", F2P, p2p, as_json=False)
    task_def, tree = swebench_import.to_task(rec, repo.parent, tmp_path / "work")
    task = write_task(task_def, tree, tmp_path / "tasks")
    ours, log, reward = run_verifier(task, task / "environment" / "app", tmp_path / "gold", rec["patch"])
    theirs = grading.get_eval_tests_report(
        parsers.parse_log_pytest(log, None), {"FAIL_TO_PASS": F2P, "PASS_TO_PASS": p2p}
    )
    assert ours == theirs and reward == "1" and grading.get_resolution_status(theirs) == "RESOLVED_FULL"


def test_record_errors_name_the_field(calc, tmp_path):
    repo, _ = calc
    with pytest.raises(swebench_import.InstanceError, match="missing base_commit"):
        swebench_import.to_task({"instance_id": "x", "repo": "a/b"}, repo.parent, tmp_path)
    bad = {k: "" for k in swebench_import.REQUIRED} | {"FAIL_TO_PASS": "[not json", "PASS_TO_PASS": []}
    with pytest.raises(swebench_import.InstanceError, match="FAIL_TO_PASS is a string but not JSON"):
        swebench_import.to_task(bad, repo.parent, tmp_path)


@pytest.mark.sandbox
@needs_bwrap
def test_import_writes_valid_tasks_and_reports_the_rest(calc, tmp_path):
    repo, shas = calc
    fix = shas["Fix div: true division"]
    clamp = shas["Fix clamp's upper bound and empty ranges"]
    good_json = record(
        repo,
        "example__calc-1",
        fix + "~1",
        fix,
        fix,
        ["tests/test_ops.py::test_div"],
        ["tests/test_ops.py::test_add"],
        as_json=True,
    )
    f2p = ["tests/test_clamp.py::TestRange::test_empty_range", "tests/test_clamp.py::test_clamp_high[7-5]"]
    good_list = record(
        repo, "example__calc-2", clamp + "~1", clamp, clamp, f2p, ["tests/test_clamp.py::test_clamp_low"], as_json=False
    )
    not_applying = dict(
        good_list, instance_id="example__calc-3", patch=good_list["patch"].replace("max(lo, x)", "max(hi, x)")
    )
    missing = dict(good_json, instance_id="other__repo-1", repo="other/repo")
    lines = [json.dumps(r) for r in (good_json, good_list, not_applying, missing)] + ["{not json"]
    instances = tmp_path / "instances.jsonl"
    instances.write_text("\n".join(lines) + "\n")
    out = tmp_path / "tasks"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "composer_jax.cli",
            "env",
            "import-swebench",
            str(instances),
            "--repos",
            str(repo.parent),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env_with_src(),
    )
    assert proc.returncode == 0, proc.stderr
    report = json.loads((out / "import_report.json").read_text())
    by_id = {r["line"]: r for r in report["instances_detail"]}
    assert [by_id[n]["status"] for n in range(1, 6)] == ["written", "written", "rejected", "rejected", "rejected"]
    assert [by_id[n].get("reason") for n in (3, 4, 5)] == [
        "patch does not apply",
        "repository missing",
        "invalid record",
    ]
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["example__calc-1", "example__calc-2"]
    import tomllib

    meta = tomllib.loads((out / "example__calc-1" / "task.toml").read_text())["metadata"]
    assert meta["instance_id"] == "example__calc-1" and meta["source"] == "swebench"
    assert meta["fail_to_pass"] == ["tests/test_ops.py::test_div"] and meta["version"] == "0.1"
    assert (out / "example__calc-2" / "instruction.md").read_text().startswith("Issue example__calc-2")


def _fmt_repo(root: Path) -> tuple[Path, str, str]:
    """A repository whose project declares tinyfmt at the base commit; (clone, base, fix)."""
    repo = root / "example__calc"
    repo.mkdir(parents=True)
    minerepo.git(repo, "init", "-q", "-b", "main")
    broken = "def show(x):\n    raise NotImplementedError\n"
    files = {"pyproject.toml": minerepo.PYPROJECT_V2, "calc/__init__.py": "", "calc/fmt.py": broken}
    base = minerepo.commit(repo, "Start fmt", {**files, "tests/test_old.py": "def test_gone():\n    pass\n"}, 1)
    minerepo.git(repo, "rm", "-q", "tests/test_old.py")
    fixed = {"calc/fmt.py": minerepo.FMT, "tests/test_fmt.py": minerepo.TEST_FMT}
    fix = minerepo.commit(repo, "Show values with tinyfmt", fixed, 2)
    return repo, base, fix


def _fmt_record(repo: Path, base: str, fix: str) -> dict:
    return record(repo, "example__calc-fmt", base, fix, fix, ["tests/test_fmt.py::test_show"], [], as_json=False)


def test_an_imported_record_declares_the_projects_environment_and_targets_existing_tests(tmp_path):
    """Its task.toml declares what the project declares at the base commit (as `env mine` does), and
    its test files are those the test patch leaves (not the file it deletes); without a wheelhouse
    or index the environment cannot be built, which is the reason given."""
    si = swebench_import
    repo, base, fix = _fmt_repo(tmp_path / "repos")
    rec = _fmt_record(repo, base, fix)
    assert "tests/test_old.py" in rec["test_patch"]  # the test patch deletes it
    task, _ = si.to_task(rec, repo.parent, tmp_path / "work")
    assert task.environment == {"requirements": ["tinyfmt"]}
    assert task.test_files == ["tests/test_fmt.py"]
    results = asyncio.run(si.import_all([(1, rec, "")], repo.parent, tmp_path / "out", default_sandbox()))
    assert (results[0]["status"], results[0]["reason"]) == ("rejected", "environment did not build"), results
    assert "give --wheelhouse or --index-url" in results[0]["detail"]


@needs_bwrap
def test_an_imported_record_whose_environment_is_declared_is_built_and_validated(tmp_path):
    from composer_jax.env.sandbox.pyenv import EnvCache

    si = swebench_import
    repo, base, fix = _fmt_repo(tmp_path / "repos")
    sandbox = default_sandbox()
    cache = EnvCache(tmp_path / "envs", sandbox, wheelhouse=minerepo.tinyfmt_wheelhouse(tmp_path / "wheels"))
    rec = _fmt_record(repo, base, fix)
    out = tmp_path / "out"
    results = asyncio.run(si.import_all([(1, rec, "")], repo.parent, out, sandbox, env_cache=cache, dated=True))
    assert results[0]["status"] == "written", results
    import tomllib

    # as of the record's created_at (pytest joins; a wheelhouse has no upload times, so pip resolves
    # over it), with what the build installed recorded as pins, which the validation then built
    env = tomllib.loads((out / "example__calc-fmt" / "task.toml").read_text())["environment"]
    assert env["requirements"] == ["pytest", "tinyfmt"] and env["exclude_newer"] == "2024-03-20T00:00:00Z"
    assert env["pins"] == ["tinyfmt==1.0"]
