"""Run the agent's tests/test_semver.py on the real library (pass) and on mutants (fail)."""
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
        module = mutant.stem.split("__")[0]
        shutil.copy(mutant, work / "semverlite" / f"{module}.py")
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                           "tests/test_semver.py"], cwd=work, capture_output=True, text=True, timeout=60)


def test_library_untouched():
    for name in ("version.py", "ranges.py"):
        assert pathlib.Path(f"/app/semverlite/{name}").read_text() == \
            pathlib.Path(f"/tests/pristine/{name}").read_text()


def test_passes_on_real_code(tmp_path):
    proc = run(tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("mutant", MUTANTS, ids=[m.stem for m in MUTANTS])
def test_catches_mutant(tmp_path, mutant):
    proc = run(tmp_path, mutant)
    assert proc.returncode == 1, f"{mutant.stem} survived:\n{proc.stdout}"
