"""The project's verifier (tasks/verifier.py, each task's tests/run_tests.py) pays on per-test
verdicts, never on pytest's exit status, and its test process cannot be steered from the workspace
without a sandbox: the levers of issue 49 that the lever scanner would also refuse are planted here
with the scanner out of the way, so the verdicts alone must hold.

Oracle for the verdicts: pytest's own JUnit XML report of the same run (the outcome of every test
of a module that has each kind: pass, fail, setup and teardown errors, skip, xfail, xpass)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from composer_jax.env.tasks import verifier

ROOT = Path(__file__).resolve().parents[3]
LRU = ROOT / "tasks" / "lru-recency-bug"


def run(app: Path, tests: Path, logs: Path, *extra: str) -> dict:
    argv = [sys.executable, "-I", str(Path(verifier.__file__)), "--app", str(app), "--tests", str(tests)]
    subprocess.run([*argv, "--logs", str(logs), *extra], check=True, capture_output=True, timeout=120)
    return json.loads((logs / "verdicts.json").read_text())


@pytest.fixture
def lru(tmp_path):
    app = tmp_path / "app"
    shutil.copytree(LRU / "environment" / "app", app)
    return app


def fix(app: Path) -> None:
    shutil.copytree(LRU / "solution" / "app", app, dirs_exist_ok=True)


def test_untouched_fails_and_the_fix_passes(lru, tmp_path):
    v = run(lru, LRU / "tests", tmp_path / "logs")
    assert v["reward"] == 0.0 and v["complete"] and v["mode"] == "suite"
    assert len(v["graded"]) == 5 and sum(t["outcome"] == "failed" for t in v["tests"].values()) == 4
    fix(lru)
    v = run(lru, LRU / "tests", tmp_path / "logs2")
    assert v["reward"] == 1.0 and v["forged"] == 0, v["why"]
    assert (tmp_path / "logs2" / "reward.txt").read_text() == "1\n"


ATTACKS = {
    # leaving before the report is complete
    "os._exit at import": "import os as _os\n_os._exit(0)\n",
    # every test skipped / xfailed: a run that exits 0
    "SkipTest everywhere": "import unittest as _u\nraise _u.SkipTest('no')\n",
    "xfail everywhere": "import pytest as _p\n_p.xfail('known')\n",
    # failing asserts become skips
    "AssertionError rebound": (
        "import builtins as _b, unittest as _u\nclass _Q(_u.SkipTest):\n    pass\n_b.AssertionError = _Q\n"
    ),
    # a signed-record forgery: lines appended to every record file it finds, without the key
    "forged records": (
        "import os as _o, json as _j\n"
        "for _d in _o.listdir('/tmp'):\n"
        "    _p = _o.path.join('/tmp', _d, 'records')\n"
        "    if _o.path.isfile(_p):\n"
        "        open(_p, 'a').write(_j.dumps({'kind': 'finish', 'exit_status': 0, 'seq': 50}) + '\\tab\\n')\n"
    ),
}


@pytest.mark.parametrize("attack", list(ATTACKS))
def test_a_lever_is_not_paid(lru, tmp_path, attack):
    """Each lever planted into the untouched package (nothing fixed: every one of them made the old
    exit-status verifier pay 1): the verdicts see an incomplete report, a module skipped or failing
    at collection, skipped tests, a forged record."""
    core = lru / "lru" / "core.py"
    core.write_text(core.read_text() + ATTACKS[attack])
    v = run(lru, LRU / "tests", tmp_path / "logs")
    assert v["reward"] == 0.0, v["why"]
    outcomes = {t["outcome"] for t in v["tests"].values()}
    if attack == "forged records":
        assert v["forged"] >= 1
    elif attack == "os._exit at import":
        assert not v["complete"]
    elif attack == "AssertionError rebound":
        assert "skipped" in outcomes and "failed" not in outcomes  # what an exit status would pay
    else:  # raised at import: the module never yields its tests
        assert v["collection_errors"] and not v["tests"]


def test_bytecode_in_the_tree_is_not_read(lru, tmp_path):
    """A tree that holds bytecode of a fixed lru/core.py beside the buggy source (unchecked hash: Python
    would load it without looking at the source) is graded on the source: the verifier deletes the
    tree's bytecode first (`drop_bytecode`), for any copy, not only a grade's carry."""
    import py_compile

    fixed = tmp_path / "fixed_core.py"
    fixed.write_text((LRU / "solution" / "app" / "lru" / "core.py").read_text())
    cache = lru / "lru" / "__pycache__" / f"core.{sys.implementation.cache_tag}.pyc"
    py_compile.compile(str(fixed), cfile=str(cache), invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
    assert verifier.drop_bytecode(tmp_path / "nothing-here") == 0
    v = run(lru, LRU / "tests", tmp_path / "logs")
    assert v["reward"] == 0.0 and not cache.exists(), v["why"]


def test_workspace_modules_cannot_shadow_the_standard_library(lru, tmp_path):
    """Text packages named like lazily imported standard-library modules (xml: pytest's JUnit
    writer; difflib: assertion diffs; unittest) stay the standard library's in the test process,
    and an honest helper named like one (calendar.py) is just a file."""
    fix(lru)
    (lru / "xml").mkdir()
    (lru / "xml" / "__init__.py").write_text("raise SystemExit(0)\n")
    (lru / "difflib.py").write_text("import os\nos._exit(0)\n")
    (lru / "calendar.py").write_text("def week():\n    return 7\n")
    v = run(lru, LRU / "tests", tmp_path / "logs")
    assert v["reward"] == 1.0 and v["complete"], v["why"]


def test_an_own_module_named_like_the_standard_library_stays_code_under_test(tmp_path):
    """config.json own_modules: a repository whose package is named like a standard-library module
    (a backport) is imported from the workspace."""
    app, tests = tmp_path / "app", tmp_path / "tests"
    (app / "tests").mkdir(parents=True)
    (app / "colorsys.py").write_text("def rgb_to_hsv(*a):\n    return 'ours'\n")
    (tests / "files" / "tests").mkdir(parents=True)
    (tests / "files" / "tests" / "test_hsv.py").write_text(
        "import colorsys\n\ndef test_hsv():\n    assert colorsys.rgb_to_hsv(1, 1, 1) == 'ours'\n"
    )
    config = {"test_files": ["tests/test_hsv.py"], "fail_to_pass": ["tests/test_hsv.py::test_hsv"]}
    config |= {"pass_to_pass": [], "own_modules": ["colorsys"]}
    (tests / "config.json").write_text(json.dumps(config))
    assert run(app, tests, tmp_path / "logs")["reward"] == 1.0
    (tests / "config.json").write_text(json.dumps({**config, "own_modules": []}))
    assert run(app, tests, tmp_path / "logs2")["reward"] == 0.0  # the standard library's rgb_to_hsv


def test_an_added_module_cannot_stand_in_for_a_library_the_tests_use(tmp_path):
    """A repository task's tests live in the workspace, so pytest's prepend mode puts their folder
    first on sys.path: a `numpy` package the change adds there would answer the tests' `import
    numpy`. An installed name resolves from the installed directories."""
    app, tests = tmp_path / "app", tmp_path / "tests"
    (app / "pkg").mkdir(parents=True)
    (app / "pkg" / "__init__.py").write_text("def ratio():\n    return 0.5\n")  # the bug: 2.0 is right
    (tests / "files" / "tests").mkdir(parents=True)
    (tests / "files" / "tests" / "test_ratio.py").write_text(
        "import numpy.testing\nfrom pkg import ratio\n\n\ndef test_ratio():\n"
        "    numpy.testing.assert_allclose(ratio(), 2.0)\n"
    )
    config = {"test_files": ["tests/test_ratio.py"], "fail_to_pass": ["tests/test_ratio.py::test_ratio"]}
    (tests / "config.json").write_text(json.dumps({**config, "pass_to_pass": [], "own_modules": ["pkg", "tests"]}))
    (app / "tests" / "numpy").mkdir(parents=True)
    (app / "tests" / "numpy" / "__init__.py").write_text("from . import testing\n")
    (app / "tests" / "numpy" / "testing.py").write_text("def assert_allclose(*a, **k):\n    pass\n")
    v = run(app, tests, tmp_path / "logs")
    assert v["reward"] == 0.0 and v["tests"]["tests/test_ratio.py::test_ratio"]["outcome"] == "failed", v["why"]
    (app / "pkg" / "__init__.py").write_text("def ratio():\n    return 2.0\n")
    assert run(app, tests, tmp_path / "logs2")["reward"] == 1.0


EVERY_OUTCOME = """\
import unittest

import pytest


class TestSub(unittest.TestCase):
    def test_a_subtest_fails(self):
        for i in range(3):
            with self.subTest(i=i):
                self.assertNotEqual(i, 1)

    def test_every_subtest_passes(self):
        for i in range(3):
            with self.subTest(i=i):
                self.assertNotEqual(i, 5)


@pytest.fixture
def broken_setup():
    raise RuntimeError("setup")


@pytest.fixture
def broken_teardown():
    yield
    raise RuntimeError("teardown")


def test_pass():
    pass


def test_fail():
    assert 1 == 2


def test_setup_error(broken_setup):
    pass


def test_teardown_error(broken_teardown):
    pass


def test_skip():
    pytest.skip("no")


@pytest.mark.xfail(reason="known")
def test_xfail():
    assert 0


@pytest.mark.xfail(reason="known")
def test_xpass():
    pass


@pytest.mark.xfail(reason="known", strict=True)
def test_xpass_strict():
    pass
"""


def junit_outcomes(path: Path) -> dict[str, str]:
    """pytest's own verdicts from its JUnit XML (a test reported twice fails if either did)."""
    out: dict[str, str] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        cls = (case.get("classname") or "").partition("test_all")[2].lstrip(".")  # after the module
        name = "::".join(["test_all.py", *([cls] if cls else []), case.get("name") or ""])
        tags = {child.tag: child for child in case}
        if "failure" in tags or "error" in tags:
            out[name] = "failed"
        elif "skipped" in tags and name not in out:
            out[name] = "xfail" if tags["skipped"].get("type") == "pytest.xfail" else "skipped"
        elif name not in out:
            out[name] = "passed"
    return out


def test_verdicts_agree_with_pytests_junit_report(tmp_path):
    app, tests = tmp_path / "app", tmp_path / "tests"
    app.mkdir()
    tests.mkdir()
    (tests / "test_all.py").write_text(EVERY_OUTCOME)
    v = run(app, tests, tmp_path / "logs")
    oracle = tmp_path / "junit.xml"
    subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={oracle}", str(tests)],
        cwd=app,
        capture_output=True,
        check=False,
    )
    ours = {k: x["outcome"] for k, x in v["tests"].items()}
    theirs = junit_outcomes(oracle)
    # JUnit writes a non-strict XPASS as a plain pass; the verdicts keep it apart (not paid)
    assert ours == {**theirs, "test_all.py::test_xpass": "xpass"}
    assert ours["test_all.py::test_xpass_strict"] == "failed" and ours["test_all.py::test_teardown_error"] == "failed"
    # a failing subtest fails its test, though the test's own call report passes (found mining tomli)
    assert ours["test_all.py::TestSub::test_a_subtest_fails"] == "failed"
    assert ours["test_all.py::TestSub::test_every_subtest_passes"] == "passed"
    assert v["reward"] == 0.0 and v["complete"] and sorted(v["graded"]) == sorted(ours)


# ---- the folding and the rules, without a run ----------------------------------------------------


def test_decide_rules():
    base = {"complete": True, "forged": 0, "graded": ["a", "b"], "mode": "repository", "rule": "passed"}
    passed = {"a": {"outcome": "passed"}, "b": {"outcome": "passed"}}
    assert verifier.decide({**base, "tests": passed})[0] == 1.0
    xfailed = {**passed, "b": {"outcome": "xfail"}}
    assert verifier.decide({**base, "tests": xfailed})[0] == 0.0
    assert verifier.decide({**base, "tests": xfailed, "rule": "swebench"})[0] == 1.0  # SWE-bench's own rule
    assert verifier.decide({**base, "tests": {"a": {"outcome": "passed"}}})[0] == 0.0  # b missing
    assert verifier.decide({**base, "tests": passed, "complete": False})[0] == 0.0
    assert verifier.decide({**base, "tests": passed, "forged": 1})[0] == 0.0
    assert verifier.decide({**base, "tests": passed, "forged": 1, "rule": "swebench"})[0] == 0.0
    assert verifier.decide({**base, "tests": {}, "graded": []})[0] == 0.0
    suite = {**base, "mode": "suite", "tests": passed}
    assert verifier.decide({**suite, "collection_errors": {"test_b.py": "ImportError"}})[0] == 0.0
    assert verifier.decide({**suite, "deselected": ["c"]})[0] == 0.0


def test_records_are_checked_line_by_line(tmp_path):
    key, path = b"k" * 32, tmp_path / "records"
    emit = verifier._signer(str(path), key)
    emit({"kind": "collected", "ids": ["t"]})
    emit({"kind": "report", "id": "t", "when": "call", "outcome": "failed"})
    emit({"kind": "finish", "exit_status": 1})
    lines = path.read_bytes().splitlines(keepends=True)
    good, forged = verifier.read_records(path, key)
    assert forged == 0 and [r["kind"] for r in good] == ["collected", "report", "finish"]
    # a line edited, a line replayed, a line dropped, an unsigned line, a line under another key
    edited = lines[1].replace(b'"failed"', b'"passed"')
    path.write_bytes(lines[0] + edited + lines[2])
    assert verifier.read_records(path, key)[1] == 2  # the edit, then the finish is out of order
    path.write_bytes(lines[0] + lines[0] + lines[1] + lines[2])
    assert verifier.read_records(path, key)[1] == 1
    path.write_bytes(lines[0] + lines[2])
    assert verifier.read_records(path, key)[1] == 1
    path.write_bytes(b"".join(lines) + b'{"kind": "finish", "seq": 3}\tdeadbeef\n')
    assert verifier.read_records(path, key)[1] == 1
    assert verifier.read_records(path, b"x" * 32) == ([], 4)


def test_fold_counts_an_unfinished_test_as_failed():
    records = [
        {"kind": "collected", "ids": ["a", "b"]},
        {"kind": "report", "id": "a", "when": "setup", "outcome": "passed"},
        {"kind": "report", "id": "a", "when": "call", "outcome": "passed"},
        {"kind": "report", "id": "a", "when": "teardown", "outcome": "passed"},
        {"kind": "report", "id": "b", "when": "setup", "outcome": "passed"},
    ]
    folded = verifier.fold(records)
    assert folded["tests"]["a"]["outcome"] == "passed" and folded["tests"]["b"]["outcome"] == "failed"
    assert folded["tests"]["b"]["message"] == verifier.UNFINISHED and not folded["complete"]
