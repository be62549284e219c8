import filecmp
import pathlib
import re
import subprocess
import sys


def test_ci_green_and_runs_all_tests():
    proc = subprocess.run(["bash", "ci.sh"], cwd="/app", capture_output=True, text=True, timeout=90)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert re.search(r"\b6 passed\b", out), out
    assert "deselected" not in out and "skipped" not in out
    assert "todo 0.4.1" in out


def test_tests_untouched():
    for f in ("test_cli.py", "test_storage.py"):
        assert filecmp.cmp(f"/app/tests/{f}", f"/tests/app_tests/{f}.orig", shallow=False), f


def test_versions_and_strict_markers():
    text = pathlib.Path("/app/pyproject.toml").read_text()
    assert re.search(r'^version\s*=\s*"0\.4\.1"', text, re.M)
    assert "--strict-markers" in text
    proc = subprocess.run([sys.executable, "-m", "todo", "--version"], cwd="/app", capture_output=True,
                          text=True, timeout=20)
    assert (proc.stdout + proc.stderr).strip() == "todo 0.4.1"
    proc = subprocess.run([sys.executable, "-m", "pytest", "--markers"], cwd="/app", capture_output=True,
                          text=True, timeout=30)
    assert "@pytest.mark.integration" in proc.stdout
