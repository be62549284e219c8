"""Run the agent's tests/test_window.py against the real library (must pass) and mutants (must fail)."""
import pathlib
import shutil
import subprocess
import sys

import pytest

MUTANTS = sorted(pathlib.Path("/tests/mutants").glob("*.py"))


def run_agent_tests(tmp_path, mutant=None):
    work = tmp_path / "ws"
    shutil.copytree("/app", work, ignore=shutil.ignore_patterns("__pycache__", ".pytest_cache"))
    if mutant is not None:
        shutil.copy(mutant, work / "ratelimit" / "window.py")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                           "tests/test_window.py"], cwd=work, capture_output=True, text=True, timeout=60)


def test_library_untouched():
    assert pathlib.Path("/app/ratelimit/window.py").read_text() == \
        pathlib.Path("/tests/pristine_window.py").read_text()


def test_agent_tests_pass_on_real_code(tmp_path):
    assert pathlib.Path("/app/tests/test_window.py").exists()
    proc = run_agent_tests(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " passed" in proc.stdout


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.stem for m in MUTANTS])
def test_agent_tests_catch_mutant(tmp_path, mutant):
    proc = run_agent_tests(tmp_path, mutant)
    assert proc.returncode == 1, f"tests did not detect {mutant.stem}:\n{proc.stdout}"
