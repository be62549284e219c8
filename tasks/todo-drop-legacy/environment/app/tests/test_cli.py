import pytest

from todo.cli import main


def run(tmp_path, capsys, *argv):
    rc = main(["--file", str(tmp_path / "t.json"), *argv])
    return rc, capsys.readouterr().out


def test_add_and_list(tmp_path, capsys):
    run(tmp_path, capsys, "add", "buy milk", "--tag", "home")
    run(tmp_path, capsys, "add", "write report")
    rc, out = run(tmp_path, capsys, "list")
    assert rc == 0
    assert out.splitlines() == ["  1 [ ] buy milk  #home", "  2 [ ] write report"]


def test_done_hides_task(tmp_path, capsys):
    run(tmp_path, capsys, "add", "a")
    run(tmp_path, capsys, "add", "b")
    run(tmp_path, capsys, "done", "1")
    assert run(tmp_path, capsys, "list")[1].splitlines() == ["  2 [ ] b"]
    assert len(run(tmp_path, capsys, "list", "--all")[1].splitlines()) == 2


def test_done_unknown(tmp_path, capsys):
    assert run(tmp_path, capsys, "done", "9")[0] == 1


@pytest.mark.integration
def test_module_entry_point(tmp_path):
    import subprocess, sys
    out = subprocess.run([sys.executable, "-m", "todo", "--file", str(tmp_path / "x.json"), "add", "z"],
                         capture_output=True, text=True)
    assert out.stdout.strip() == "added 1"
