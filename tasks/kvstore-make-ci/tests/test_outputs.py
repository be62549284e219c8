import filecmp
import re
import subprocess


def test_make_ci_green():
    proc = subprocess.run(["make", "ci"], cwd="/app", capture_output=True, text=True, timeout=90)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "lint ok" in out
    assert re.search(r"\b2 passed\b", out), out


def test_make_targets_individually():
    for target in ("lint", "test"):
        proc = subprocess.run(["make", target], cwd="/app", capture_output=True, text=True, timeout=90)
        assert proc.returncode == 0, target


def test_checks_not_weakened():
    assert filecmp.cmp("/app/scripts/check_no_prints.py", "/tests/orig/check_no_prints.py.orig", shallow=False)
    assert filecmp.cmp("/app/tests/test_store.py", "/tests/orig/test_store.py.orig", shallow=False)
    mk = open("/app/Makefile").read()
    assert re.search(r"^ci:.*\blint\b.*\btest\b|^ci:.*\btest\b.*\blint\b", mk, re.M)


def test_store_is_quiet(tmp_path):
    proc = subprocess.run(["python3", "-c", f"from kvstore import Store; s = Store({str(tmp_path / 'x')!r}); "
                           "s.set('a', '1'); print(s.get('a'))"], cwd="/app", capture_output=True, text=True)
    assert proc.stdout == "1\n"
