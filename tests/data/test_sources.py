"""Each source type on tiny files in tmp_path, directory filters + dedup, and the errors users cause."""

import json

import pytest
from support.datahelpers import write_jsonl

from composer_jax.config.data import DataConfigError, SourceConfig
from composer_jax.data.sources import (
    ChatDocument,
    DataFormatError,
    content_hash_fraction,
    list_directory_files,
    open_source,
)

DOCS = ["def a():\n    pass\n", "print('b')\n", "# c\n\nSome *markdown*.\n"]


def test_jsonl_files_directory_and_glob(tmp_path):
    write_jsonl(tmp_path / "p1.jsonl", [{"text": DOCS[0]}, {"text": DOCS[1], "meta": 1}])
    # a blank line is skipped and does not count as a document
    (tmp_path / "p2.jsonl").write_text(json.dumps({"body": DOCS[2]}) + "\n\n")
    src = open_source(SourceConfig(type="jsonl", path=str(tmp_path / "p1.jsonl")), "text")
    assert [src[i] for i in range(len(src))] == DOCS[:2]
    by_dir = open_source(SourceConfig(type="jsonl", path=str(tmp_path)), "text")
    assert len(by_dir) == 3 and by_dir[1] == DOCS[1]
    with pytest.raises(DataFormatError, match=r"p2.jsonl:1: record has no key 'text'.*set the source's text_key"):
        by_dir[2]
    body = open_source(SourceConfig(type="jsonl", path=str(tmp_path / "p2*.jsonl"), text_key="body"), "text")
    assert [body[i] for i in range(len(body))] == [DOCS[2]]


def test_jsonl_bad_line_names_file_and_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "ok"}\n\n{"text": "broken\n{"text": 3}\n[1, 2]\n')
    src = open_source(SourceConfig(type="jsonl", path=str(f)), "text")
    assert src[0] == "ok"
    with pytest.raises(DataFormatError, match=r"bad.jsonl:3: not valid JSON .*each line must be one JSON object"):
        src[1]
    with pytest.raises(DataFormatError, match=r"bad.jsonl:4: 'text' must be a string, got int"):
        src[2]
    with pytest.raises(DataFormatError, match=r"bad.jsonl:5: expected a JSON object with key 'text', got list"):
        src[3]


def test_parquet_text_and_chat_columns(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    pq.write_table(pa.table({"text": DOCS, "messages": [json.dumps(msgs)] * 3}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"text": ["last"], "messages": [json.dumps(msgs)]}), tmp_path / "b.parquet")
    src = open_source(SourceConfig(type="parquet", path=str(tmp_path)), "text")
    assert [src[i] for i in range(len(src))] == DOCS + ["last"]
    chat = open_source(SourceConfig(type="parquet", path=str(tmp_path / "a.parquet")), "messages")
    assert chat[2] == ChatDocument(msgs, None)
    with pytest.raises(
        DataFormatError, match=r"a.parquet: parquet file has no column 'content'.*columns: \['text', 'messages'\]"
    ):
        open_source(SourceConfig(type="parquet", path=str(tmp_path / "a.parquet"), text_key="content"), "text")


def test_arrayrecord_text_and_json_records(tmp_path):
    from array_record.python.array_record_module import ArrayRecordWriter

    path = tmp_path / "c.array_record"
    w = ArrayRecordWriter(str(path), "group_size:1")
    for rec in [DOCS[0].encode(), json.dumps({"text": DOCS[1]}).encode(), b"{not json but text", b"\xff\xfe"]:
        w.write(rec)
    w.close()
    src = open_source(SourceConfig(type="arrayrecord", path=str(path)), "text")
    assert len(src) == 4
    assert [src[0], src[1], src[2]] == [DOCS[0], DOCS[1], "{not json but text"]
    with pytest.raises(DataFormatError, match=r"c.array_record: record 3: not UTF-8"):
        src[3]


def test_directory_filters_and_dedup(tmp_path):
    root = tmp_path / "repo"
    for rel, content in {
        "a.py": "x = 1\n",
        "pkg/b.py": "y = 2\n",
        "pkg/copy_of_a.py": "x = 1\n",  # duplicate of a.py
        "README.md": "# r\n",
        "run.sh": "echo\n",
        "data.bin": "ignored ext\n",
        "img.py": "\x00binary",
        "big.py": "z" * 5000,
        ".git/config.py": "no\n",
        "pkg/__pycache__/m.py": "no\n",
        "gen/out.py": "generated\n",
        "pkg/latin1.py": None,
    }.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"caf\xe9\n" if content is None else content.encode())
    files = list_directory_files(root, include=(".py", ".md", ".sh"), exclude=("gen/**",), max_file_bytes=1000)
    # dedup keeps the first of identical files in sorted path order; binary, non-UTF-8, too large,
    # excluded and cache/VCS paths are dropped
    assert files == ["README.md", "a.py", "pkg/b.py", "run.sh"]
    assert list_directory_files(root, include=("pkg/*.py",), exclude=(), max_file_bytes=10_000) == [
        "pkg/b.py",
        "pkg/copy_of_a.py",
    ]
    src = open_source(SourceConfig(type="directory", path=str(root), include=(".py",), max_file_bytes=1000), "text")
    assert [src[i] for i in range(len(src))] == ["x = 1\n", "generated\n", "y = 2\n"]


def test_errors_for_bad_sources(tmp_path):
    with pytest.raises(
        DataConfigError, match=r"source path '.*missing.jsonl' does not exist .*give a file, a directory or a glob"
    ):
        open_source(SourceConfig(type="jsonl", path=str(tmp_path / "missing.jsonl")), "text")
    with pytest.raises(
        DataConfigError, match=r"type='csv' is not accepted; accepted: jsonl, parquet, arrayrecord, directory"
    ):
        open_source(SourceConfig(type="csv", path=str(tmp_path)), "text")
    with pytest.raises(DataConfigError, match=r"matches no files \(looked for '\*.parquet'\)"):
        open_source(SourceConfig(type="parquet", path=str(tmp_path)), "text")
    with pytest.raises(DataConfigError, match="has no files matching include"):
        open_source(SourceConfig(type="directory", path=str(tmp_path)), "text")


def test_split_hash_is_stable_and_uniform():
    # A fixed value (BLAKE2b-64 of the UTF-8 bytes, personalised "cj-split") guards against the split
    # silently changing between versions, which would leak eval documents into training.
    assert content_hash_fraction("def f(): pass\n") == content_hash_fraction("def f(): pass\n")
    import hashlib

    want = int.from_bytes(hashlib.blake2b(b"abc", digest_size=8, person=b"cj-split").digest(), "little") / 2**64
    assert content_hash_fraction("abc") == want
    fr = [content_hash_fraction(f"doc {i}") for i in range(4000)]
    assert abs(sum(f < 0.1 for f in fr) / 4000 - 0.1) < 0.02
