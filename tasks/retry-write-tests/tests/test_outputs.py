"""Run the agent's tests/test_retrying.py on the real package (pass) and on mutants (fail)."""
import pathlib
import shutil
import subprocess
import sys

import pytest

MUTANTS = sorted(pathlib.Path("/tests/mutants").glob("*.py"))


def run(tmp_path, mutant=None):
    work = tmp_path / "ws"
    shutil.copytree("/app", work, ignore=shutil.ignore_patterns("__pycache__"))
    if mutant is not None:
        shutil.copy(mutant, work / "retrying" / (mutant.stem.split("__")[0] + ".py"))
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           "tests/test_retrying.py"], cwd=work, capture_output=True, text=True, timeout=60)


def test_package_untouched():
    for f in pathlib.Path("/tests/pristine").glob("*.py"):
        assert pathlib.Path("/app/retrying", f.name).read_text() == f.read_text(), f.name


def test_passes_on_real_code(tmp_path):
    proc = run(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.stem for m in MUTANTS])
def test_catches_mutant(tmp_path, mutant):
    proc = run(tmp_path, mutant)
    assert proc.returncode == 1, f"{mutant.stem} survived:\n{proc.stdout}"
