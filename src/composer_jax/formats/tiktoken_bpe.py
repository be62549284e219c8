"""A checkpoint's tiktoken-format BPE (Kimi K2's `tiktoken.model`, Qwen's `qwen.tiktoken`) as a
`tokenizers.Tokenizer`-shaped engine for `formats.tokenizer.Tokenizer`.

The rank file is one `base64(token bytes) rank` pair per line; the split pattern is the model
family's (Kimi K2's below, from its `tokenization_kimi.py`; a `pat_str` in tokenizer_config.json
overrides it); the special tokens and their ids come from tokenizer_config.json's
`added_tokens_decoder` ({id: {"content": ...}}). The `tiktoken` library is the engine (its
`Encoding`), so merging is the library's, not ours. Documents are encode-only: special-token text
in them is encoded as ordinary bytes (`disallowed_special=()`), and a chat template's own text,
which holds them on purpose, goes through `encode_with_specials`.

Kimi K2's tokenizer (its `tokenization_kimi.py` `encode`, the rule Llama 3's tiktoken tokenizer
introduced for openai/tiktoken#195) cuts the text before BPE: into chunks of at most 400,000
characters, and each chunk wherever a run of consecutive whitespace or consecutive non-whitespace
characters (`str.isspace`) would exceed 25,000, the cut falling after the 25,000th character of
the run. A cut can separate characters the split pattern would have kept in one piece, so the ids
differ from an uncut encoding: a tokenizer with Kimi's pattern cuts the same way (`kimi_pieces`).
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from composer_jax.config.data import DataConfigError

# Kimi K2's pre-tokenisation (tokenization_kimi.py, `pat_str`): Han runs first, letters without Han,
# up to three digits, punctuation runs, newlines, spaces.
KIMI_PATTERN = "|".join(
    [
        r"[\p{Han}]+",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)
RANK_FILES = ("tiktoken.model", "*.tiktoken")
KIMI_MAX_ENCODE_CHARS = 400_000  # one chunk handed to tiktoken
KIMI_MAX_RUN_CHARS = 25_000  # consecutive whitespace or non-whitespace characters in one piece
# Python's `\s` in a str pattern is exactly `str.isspace` (both are Py_UNICODE_ISSPACE), so these
# runs are the rule's runs, found in C rather than by a per-character loop.
_RUNS = re.compile(r"\s+|\S+")


def kimi_pieces(text: str) -> list[str]:
    """`text` cut as Kimi K2's tokenizer cuts it before BPE (module docstring); "".join() restores it."""
    if len(text) <= KIMI_MAX_RUN_CHARS:  # no run can exceed the limit, and one chunk holds it all
        return [text]
    pieces: list[str] = []
    for chunk_start in range(0, len(text), KIMI_MAX_ENCODE_CHARS):
        chunk = text[chunk_start : chunk_start + KIMI_MAX_ENCODE_CHARS]
        cut = 0
        for run in _RUNS.finditer(chunk):
            start, end = run.span()
            for at in range(start + KIMI_MAX_RUN_CHARS, end, KIMI_MAX_RUN_CHARS):
                pieces.append(chunk[cut:at])
                cut = at
        pieces.append(chunk[cut:])
    return pieces


def rank_file(directory: Path) -> Path | None:
    """The tiktoken rank file a checkpoint directory ships, if any."""
    for pattern in RANK_FILES:
        found = sorted(directory.glob(pattern))
        if found:
            return found[0]
    return None


def read_ranks(path: Path) -> dict[bytes, int]:
    """`base64 rank` lines -> {token bytes: rank}; DataConfigError naming the file, line and form."""
    ranks: dict[bytes, int] = {}
    for n, line in enumerate(path.read_bytes().splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split()
        try:
            if len(parts) != 2:
                raise ValueError
            ranks[base64.b64decode(parts[0], validate=True)] = int(parts[1])
        except (ValueError, binascii.Error):
            raise DataConfigError(
                f"{path}: line {n} is not a tiktoken rank line; expected 'BASE64_TOKEN RANK', got {line[:80]!r}"
            ) from None
    return ranks


def _byte_level(data: bytes) -> str:
    """bytes -> GPT-2's byte-level alphabet (what `id_to_token` returns, as tokenizers' does)."""
    from composer_jax.formats.byte_level import BYTE_TO_CHAR

    return "".join(BYTE_TO_CHAR[b] for b in data)


@dataclass
class _Encoding:
    ids: list[int]


class TiktokenBPE:
    """The subset of `tokenizers.Tokenizer` that `formats.tokenizer.Tokenizer` and its users call,
    over a `tiktoken.Encoding`."""

    def __init__(
        self, name: str, ranks: dict[bytes, int], pattern: str, specials: dict[str, int], *, cut_long_runs: bool = False
    ):
        """`cut_long_runs`: cut the text as Kimi K2's tokenizer does before BPE (`kimi_pieces`)."""
        import tiktoken

        taken = set(ranks.values())
        for token, i in specials.items():
            if i in taken:
                clash = next(b for b, r in ranks.items() if r == i)
                raise DataConfigError(
                    f"special token {token!r} has id {i}, which the rank file already gives to {clash!r}"
                )
        self.enc = tiktoken.Encoding(name=name, pat_str=pattern, mergeable_ranks=ranks, special_tokens=specials)
        self.specials = dict(specials)
        self._by_id = {i: t for t, i in specials.items()}
        self._size = max([*ranks.values(), *specials.values()]) + 1
        self.cut_long_runs = cut_long_runs

    def get_vocab_size(self, with_added_tokens: bool = True) -> int:
        return self._size

    def _encode_many(self, texts: list[str], **special: Any) -> list[list[int]]:
        """Each text's ids, every text cut into `kimi_pieces` first where this tokenizer cuts."""
        if not self.cut_long_runs or all(len(t) <= KIMI_MAX_RUN_CHARS for t in texts):
            return self.enc.encode_batch(texts, **special) if len(texts) > 1 else [self.enc.encode(texts[0], **special)]
        cut = [kimi_pieces(t) for t in texts]
        flat = self.enc.encode_batch([p for pieces in cut for p in pieces], **special)
        out, n = [], 0
        for pieces in cut:
            out.append([i for ids in flat[n : n + len(pieces)] for i in ids])
            n += len(pieces)
        return out

    def encode(self, text: str, add_special_tokens: bool = False) -> _Encoding:
        return _Encoding(self._encode_many([text], disallowed_special=())[0])

    def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = False) -> list[_Encoding]:
        return [_Encoding(ids) for ids in self._encode_many(list(texts), disallowed_special=())] if texts else []

    def encode_with_specials(self, text: str) -> list[int]:
        return self._encode_many([text], allowed_special="all")[0]

    def offsets_with_specials(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """`encode_with_specials` and each token's character span [start, end) in `text` (a token
        that ends inside a character is given the character it starts)."""
        ids = self.encode_with_specials(text)
        _, starts = self.enc.decode_with_offsets(ids)
        ends = [*starts[1:], len(text)]
        return ids, list(zip(starts, ends, strict=True))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids if not (skip_special_tokens and int(i) in self._by_id)]
        return self.enc.decode(ids)

    def token_to_id(self, token: str) -> int | None:
        if token in self.specials:
            return self.specials[token]
        try:
            return self.enc.encode_single_token(token.encode("utf-8"))
        except KeyError:
            return None

    def id_to_token(self, i: int) -> str | None:
        if i in self._by_id:
            return self._by_id[i]
        try:
            return _byte_level(self.enc.decode_single_token_bytes(i))
        except KeyError:
            return None

    def get_added_tokens_decoder(self) -> dict[int, Any]:
        return {i: t for t, i in self.specials.items()}


def special_tokens(config: dict) -> dict[str, int]:
    """tokenizer_config.json's `added_tokens_decoder` -> {content: id}."""
    out: dict[str, int] = {}
    for key, entry in (config.get("added_tokens_decoder") or {}).items():
        content = entry.get("content") if isinstance(entry, dict) else entry
        if isinstance(content, str):
            out[content] = int(key)
    return out


def load(directory: Path, config: dict) -> TiktokenBPE:
    """The engine of a checkpoint directory holding a tiktoken rank file (`rank_file`)."""
    path = rank_file(directory)
    if path is None:
        raise DataConfigError(f"{directory}: no tiktoken rank file ({', '.join(RANK_FILES)})")
    pattern = config.get("pat_str") or KIMI_PATTERN
    cut = pattern == KIMI_PATTERN  # Kimi's tokenizer cuts long runs before BPE; Qwen's does not
    return TiktokenBPE(path.stem, read_ranks(path), pattern, special_tokens(config), cut_long_runs=cut)
