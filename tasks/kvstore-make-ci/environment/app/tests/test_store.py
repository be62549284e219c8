from kvstore import Store


def test_persist(tmp_path):
    p = tmp_path / "s.jsonl"
    s = Store(p)
    s.set("a", "1"); s.set("b", "2"); s.delete("a")
    assert Store(p).keys() == ["b"]


def test_prefix(tmp_path):
    s = Store(tmp_path / "s.jsonl")
    for k in ("user:1", "user:2", "cfg"):
        s.set(k, "x")
    assert s.keys("user:") == ["user:1", "user:2"]
