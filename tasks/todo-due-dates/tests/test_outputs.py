import datetime
import json

import pytest

from todo.cli import main


def run(tmp_path, capsys, *argv):
    rc = main(["--file", str(tmp_path / "t.json"), *argv])
    return rc, capsys.readouterr().out


def test_add_with_due_and_list(tmp_path, capsys):
    run(tmp_path, capsys, "add", "pay rent", "--due", "2030-01-31", "--tag", "home")
    run(tmp_path, capsys, "add", "no date")
    out = run(tmp_path, capsys, "list")[1].splitlines()
    assert out == ["  1 [ ] pay rent  #home  due 2030-01-31", "  2 [ ] no date"]
    data = json.loads((tmp_path / "t.json").read_text())
    assert data[0]["due"] == "2030-01-31" and data[1]["due"] is None


@pytest.mark.parametrize("bad", ["2030-02-30", "tomorrow", "31/01/2030"])
def test_bad_date_rejected(tmp_path, capsys, bad):
    with pytest.raises(SystemExit) as err:
        main(["--file", str(tmp_path / "t.json"), "add", "x", "--due", bad])
    assert err.value.code == 2
    assert not (tmp_path / "t.json").exists()


def test_overdue(tmp_path, capsys):
    run(tmp_path, capsys, "add", "old", "--due", "2024-03-01")
    run(tmp_path, capsys, "add", "today", "--due", "2024-03-10")
    run(tmp_path, capsys, "add", "later", "--due", "2024-04-01")
    run(tmp_path, capsys, "add", "undated")
    run(tmp_path, capsys, "add", "old but done", "--due", "2024-01-01")
    run(tmp_path, capsys, "done", "5")
    out = run(tmp_path, capsys, "list", "--overdue", "--today", "2024-03-10")[1].splitlines()
    assert out == ["  1 [ ] old  due 2024-03-01"]
    out = run(tmp_path, capsys, "list", "--overdue", "--today", "2024-03-11")[1].splitlines()
    assert [l.split()[0] for l in out] == ["1", "2"]


def test_overdue_defaults_to_real_today(tmp_path, capsys):
    yesterday = (datetime.date.today() - datetime.timedelta(days=1)).isoformat()
    tomorrow = (datetime.date.today() + datetime.timedelta(days=1)).isoformat()
    run(tmp_path, capsys, "add", "y", "--due", yesterday)
    run(tmp_path, capsys, "add", "t", "--due", tomorrow)
    assert [l.split()[0] for l in run(tmp_path, capsys, "list", "--overdue")[1].splitlines()] == ["1"]


def test_old_files_load(tmp_path, capsys):
    (tmp_path / "t.json").write_text(json.dumps([{"id": 1, "title": "legacy", "done": False, "tags": []}]))
    assert run(tmp_path, capsys, "list")[1] == "  1 [ ] legacy\n"
