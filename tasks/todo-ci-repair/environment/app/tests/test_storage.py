from todo import storage
from todo.models import Task


def test_round_trip(tmp_path):
    p = tmp_path / "t.json"
    storage.save(p, [Task(1, "a", tags=["x"]), Task(2, "b", done=True)])
    assert storage.load(p) == [Task(1, "a", tags=["x"]), Task(2, "b", done=True)]


def test_missing_file_is_empty(tmp_path):
    assert storage.load(tmp_path / "nope.json") == []
