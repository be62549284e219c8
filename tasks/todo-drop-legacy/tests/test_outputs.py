import pathlib
import subprocess
import sys

import pytest

from todo.cli import main

APP = pathlib.Path("/app")


def run(tmp_path, capsys, *argv):
    rc = main(["--file", str(tmp_path / "t.json"), *argv])
    return rc, capsys.readouterr().out


def test_module_gone():
    assert not (APP / "todo" / "legacy.py").exists()
    for path in list(APP.rglob("*.py")) + [APP / "README.md"]:
        text = path.read_text().lower()
        assert "legacy" not in text and "to_legacy_line" not in text, path


def test_flag_rejected(tmp_path, capsys):
    with pytest.raises(SystemExit) as err:
        main(["--file", str(tmp_path / "t.json"), "list", "--legacy"])
    assert err.value.code == 2


def test_behaviour_unchanged(tmp_path, capsys):
    run(tmp_path, capsys, "add", "buy milk", "--tag", "home", "--tag", "now")
    run(tmp_path, capsys, "add", "b")
    run(tmp_path, capsys, "done", "2")
    assert run(tmp_path, capsys, "list")[1] == "  1 [ ] buy milk  #home #now\n"
    assert run(tmp_path, capsys, "list", "--all")[1].splitlines()[1] == "  2 [x] b"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests"], cwd="/app",
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout
