import json
import os
from unittest import mock

import pytest

from kvstore import Store


def records(path):
    return [json.loads(l) for l in open(path) if l.strip()]


def test_compact_basic(tmp_path):
    p = tmp_path / "db.jsonl"
    s = Store(p)
    s.set("b", "1"); s.set("a", "1"); s.set("b", "2"); s.delete("a"); s.set("c", "3"); s.set("a", "9")
    assert s.compact() == 3
    assert records(p) == [{"k": "a", "v": "9"}, {"k": "b", "v": "2"}, {"k": "c", "v": "3"}]
    assert s.compact() == 0
    s.set("d", "4"); s.delete("d")
    assert s.compact() == 2
    assert Store(p).keys() == ["a", "b", "c"] and Store(p).get("b") == "2"


def test_counts_records_loaded_from_disk(tmp_path):
    p = tmp_path / "db.jsonl"
    s = Store(p)
    for i in range(5):
        s.set("k", str(i))
    assert Store(p, compact_threshold=None).compact() == 4


def test_atomic_on_failure(tmp_path):
    p = tmp_path / "db.jsonl"
    s = Store(p)
    s.set("a", "1"); s.set("a", "2")
    before = p.read_text()
    with mock.patch("os.replace", side_effect=OSError("disk full")):
        with pytest.raises(OSError):
            s.compact()
    assert p.read_text() == before
    assert sorted(os.listdir(tmp_path)) == ["db.jsonl"]


def test_auto_compaction_on_open(tmp_path):
    p = tmp_path / "db.jsonl"
    s = Store(p, compact_threshold=None)
    for i in range(12):
        s.set("x", str(i))
    Store(p, compact_threshold=20)
    assert len(records(p)) == 12
    Store(p, compact_threshold=10)
    assert records(p) == [{"k": "x", "v": "11"}]
    s2 = Store(p)  # default threshold 1000: nothing to do
    assert s2.get("x") == "11"
    big = Store(tmp_path / "big.jsonl", compact_threshold=None)
    for i in range(1002):
        big.set("y", str(i))
    Store(tmp_path / "big.jsonl")
    assert len(records(tmp_path / "big.jsonl")) == 1
