"""Tokenizer: training a byte-level BPE on code, round trips, special tokens, the shipped asset, CLI."""

import json

import pytest
from support.datahelpers import REPO

from composer_jax.cli import main as cli_main
from composer_jax.config.data import DataConfigError
from composer_jax.data.tokenizer_cli import main
from composer_jax.formats.tokenizer import SPECIAL_TOKENS, load_tokenizer, save_tokenizer, train_tokenizer

CODE = [
    'def add(a, b):\n    """Sum."""\n    return a + b\n',
    "for i in range(10):\n\tprint(f'{i:>3}')  # tabs, unicode: é ✓ 🙂\n",
    '#!/usr/bin/env bash\nset -euo pipefail\necho "$HOME" | tr a-z A-Z\n',
] * 20


def test_train_round_trip_and_special_ids(tmp_path):
    tok = train_tokenizer(CODE, vocab_size=300)
    # special tokens take ids 0..6 in the documented order; 256 byte symbols follow
    assert [tok.special[t] for t in SPECIAL_TOKENS] == list(range(7))
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.vocab_size == 300
    for text in CODE[:3] + ["never seen: λx. x ∘ y \x7f\u2028 end"]:
        ids = tok.encode(text)
        assert min(ids) >= len(SPECIAL_TOKENS)  # plain text never produces a special id
        assert tok.decode(ids) == text
    save_tokenizer(tok, tmp_path / "t")
    again = load_tokenizer(tmp_path / "t" / "tokenizer.json")  # a file works as well as its directory
    assert again.encode(CODE[0]) == tok.encode(CODE[0])
    cfg = json.loads((tmp_path / "t" / "tokenizer_config.json").read_text())
    assert cfg["special_tokens"]["<|im_end|>"] == 4 and cfg["chat_template_name"] == "composer-chatml-v1"


def test_special_token_text_in_documents_is_not_a_special_token(tok):
    # A source file that mentions "<|im_end|>" must not close a chat turn.
    ids = tok.encode("x = '<|im_end|>'")
    assert tok.token_id("<|im_end|>") not in ids
    assert tok.decode(ids) == "x = '<|im_end|>'"


def test_shipped_tokenizer_is_small_and_round_trips_repo_code(tok):
    assert 1024 <= tok.vocab_size <= 4096
    size = sum(p.stat().st_size for p in (REPO / "assets" / "tokenizer").iterdir())
    assert size < 1_000_000
    text = (REPO / "src" / "composer_jax" / "config" / "loader.py").read_text()
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(text) / len(ids) > 2.0  # it learned code: well over one byte per token
    assert set(SPECIAL_TOKENS) <= set(tok.special)


def test_load_errors(tmp_path):
    with pytest.raises(DataConfigError, match="no tokenizer.json there"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(DataConfigError, match="could not be read"):
        load_tokenizer(tmp_path)
    with pytest.raises(DataConfigError, match="too small"):
        train_tokenizer(CODE, vocab_size=100)


def test_cli_train(tmp_path, capsys):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i, t in enumerate(CODE[:3]):
        (corpus / f"f{i}.py").write_text(t * 5)
    (corpus / "skip.bin").write_bytes(b"\x00\x01")
    assert main(["train", "--corpus", str(corpus), "--vocab-size", "280", "--out", str(tmp_path / "out")]) == 0
    assert "trained vocab 280 on 3 files" in capsys.readouterr().out
    assert load_tokenizer(tmp_path / "out").vocab_size == 280
    assert cli_main(["tokenizer", "train", "--corpus", str(tmp_path / "nope"), "--out", str(tmp_path / "o2")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_encode_with_specials_reads_special_strings_encode_does_not(tok, tok_dir):
    """Rendered templates need `<|im_end|>` as its id; documents keep it as plain bytes."""
    from pathlib import Path

    text = "a<|im_end|>\nb"
    assert tok.encode_with_specials(text) == tok.encode("a") + [tok.token_id("<|im_end|>")] + tok.encode("\nb")
    assert tok.token_id("<|im_end|>") not in tok.encode(text)  # perturbed: the plain encoding differs
    ids, offsets = tok.offsets_with_specials(text)
    assert "".join(text[a:b] for a, b in offsets) == text and len(ids) == len(offsets)
    assert Path(tok.source or "") == Path(tok_dir)
