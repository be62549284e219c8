"""Tokenizer: a Hugging Face `tokenizers` byte-level BPE (`tokenizer.json`) or a tiktoken-format
BPE (`formats/tiktoken_bpe.py`), with its special tokens.

`load_tokenizer(path)` accepts a `tokenizer.json` file or a directory holding one (a checkpoint
directory, `assets/tokenizer/`), or a checkpoint directory with a tiktoken rank file (Kimi K2's
`tiktoken.model`, a `*.tiktoken`); BOS / EOS / PAD and the added tokens come from the
checkpoint's own tokenizer_config.json. `composer-jax tokenizer train` trains a small byte-level BPE on
code and writes `tokenizer.json` and `tokenizer_config.json` (special tokens, their ids and the
chat template name, see formats/chatml.py).

Special tokens (ids 0..6 in tokenizers we train, in this order):
  <|pad|>          padding in packed rows (never a target)
  <|bos|>          first token of every document / conversation
  <|eos|>          last token of every document / conversation
  <|im_start|>     opens a chat turn: `<|im_start|>role\\n`
  <|im_end|>       closes a chat turn; the model's stop token in assistant turns
  <|tool_call|>    inside an assistant turn, followed by one JSON object {"id","name","arguments"}
  <|tool_result|>  starts the content of a tool turn: `<|tool_result|>{tool_call_id}\\n{content}`
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from composer_jax.config.data import DataConfigError

SPECIAL_TOKENS = ("<|pad|>", "<|bos|>", "<|eos|>", "<|im_start|>", "<|im_end|>", "<|tool_call|>", "<|tool_result|>")
CHAT_TEMPLATE_NAME = "composer-chatml-v1"


@dataclass(frozen=True)
class Tokenizer:
    """A loaded `tokenizers.Tokenizer` with the ids of our special tokens.

    `encode` never adds special tokens itself: the pipeline places BOS/EOS explicitly, and special
    token strings inside a document's text are encoded as ordinary bytes (so a source file that
    mentions "<|im_end|>" cannot forge a turn boundary).
    """

    hf: Any  # tokenizers.Tokenizer, or a TiktokenBPE shaped like one (imported lazily)
    pad_id: int
    bos_id: int
    eos_id: int
    special: dict  # special token string -> id (those present)
    source: Path | None = None  # the directory it was loaded from (its chat template lives there)
    # a loaded tokenizer.json: the ids its own file flags special (decode's skip_special_tokens and
    # the export keep these; in `hf` every added token is special, so none is matched in a document)
    skip_ids: frozenset[int] | None = None

    @property
    def vocab_size(self) -> int:
        return self.hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """text -> token ids (no special tokens added; special-token strings are not matched)."""
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self.hf.encode_batch(list(texts), add_special_tokens=False)]

    def encode_with_specials(self, text: str) -> list[int]:
        """text -> token ids with the tokenizer's added-token strings (`<|im_end|>`, ...) read as their
        ids, as transformers encodes a rendered chat template. Only for text the project itself
        rendered: a document's own text goes through `encode`, where such strings stay plain bytes."""
        return self.offsets_with_specials(text)[0]

    def offsets_with_specials(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """As `encode_with_specials`, with each token's character span [start, end) in `text`."""
        if hasattr(self.hf, "offsets_with_specials"):  # the tiktoken engine
            return self.hf.offsets_with_specials(text)
        reader = self.__dict__.get("_specials_reader")
        if reader is None:  # a second tokenizers object: the shared one's flag must stay as `encode` needs it
            reader = type(self.hf).from_str(self.hf.to_str())  # every added token matched
            reader.encode_special_tokens = False
            object.__setattr__(self, "_specials_reader", reader)  # a frozen dataclass; derived state
        enc = reader.encode(text, add_special_tokens=False)
        return enc.ids, [tuple(o) for o in enc.offsets]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        if self.skip_ids is None:
            return self.hf.decode(list(map(int, ids)), skip_special_tokens=skip_special_tokens)
        keep = [int(i) for i in ids if not (skip_special_tokens and int(i) in self.skip_ids)]
        return self.hf.decode(keep, skip_special_tokens=False)

    def tokenizer_json(self) -> str:
        """The tokenizer.json text, with the file's own special flags (`skip_ids`) where loaded."""
        text = self.hf.to_str()
        if self.skip_ids is None:
            return text
        data = json.loads(text)
        for added in data.get("added_tokens") or []:
            added["special"] = added["id"] in self.skip_ids
        return json.dumps(data, ensure_ascii=False)

    def token_id(self, token: str) -> int:
        """Id of a special token such as "<|im_start|>"; error names the tokens this tokenizer has."""
        if token not in self.special:
            raise DataConfigError(
                f"tokenizer has no special token {token!r}; it has {sorted(self.special)}. "
                "Chat formatting needs the tokens listed in composer_jax.formats.tokenizer."
                "SPECIAL_TOKENS (train one with `composer-jax tokenizer train`)"
            )
        return self.special[token]


def _tokenizer_file(path: str | Path) -> Path:
    p = Path(path)
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise DataConfigError(
            f"tokenizer {str(path)!r}: no tokenizer.json there (resolved against the "
            f"current directory {Path.cwd()}); give a tokenizer.json file, a directory "
            "holding one (e.g. assets/tokenizer), or a checkpoint directory with a tiktoken rank "
            "file (tiktoken.model, *.tiktoken) and its tokenizer_config.json"
        )
    return p


def _config(directory: Path) -> dict:
    f = directory / "tokenizer_config.json"
    if not f.is_file():
        return {}
    try:
        return json.loads(f.read_text())
    except ValueError as e:
        raise DataConfigError(f"{f} is not JSON: {e}") from None


def _token_name(v: Any) -> str | None:
    v = v.get("content") if isinstance(v, dict) else v
    return v if isinstance(v, str) else None


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Load `tokenizer.json` (a file, or a directory containing it) and find the special token ids.

    Ids come from tokenizer_config.json next to it when present ("special_tokens": {name: id};
    HF's "bos_token"/"eos_token"/"pad_token" name them in converted tokenizers such as
    DeepSeek's), else from the vocabulary by name; BOS/EOS fall back to the common "<s>"/"</s>" and
    "<|endoftext|>" names of other tokenizers, PAD to EOS.
    """
    from composer_jax.formats import tiktoken_bpe

    p = Path(path)
    flagged: frozenset[int] | None = None
    if p.is_dir() and not (p / "tokenizer.json").is_file() and tiktoken_bpe.rank_file(p) is not None:
        saved = _config(p)
        hf: Any = tiktoken_bpe.load(p, saved)
        file = p / "tiktoken.model"
    else:
        file = _tokenizer_file(path)
        hf, flagged = _encode_only(file)
        saved = _config(file.parent)
    special = {t: hf.token_to_id(t) for t in SPECIAL_TOKENS if hf.token_to_id(t) is not None}
    # a checkpoint's added tokens (its chat and tool-call markers) by name
    special.update({str(getattr(t, "content", t)): int(i) for i, t in hf.get_added_tokens_decoder().items()})
    special.update({k: int(v) for k, v in saved.get("special_tokens", {}).items()})
    named: dict[str, tuple[str, ...]] = {}  # HF's bos_token / eos_token / pad_token ({"content": ...} too)
    for key in ("bos_token", "eos_token", "pad_token"):
        v = _token_name(saved.get(key))
        if v is not None and hf.token_to_id(v) is not None:
            named[key] = (v,)

    def find(names: Iterable[str]) -> int | None:
        # the config's own names by any id; the fallback names only as special or added tokens (an
        # ordinary BPE piece spelled "<s>" is text, not a sentence boundary)
        for n in names:
            i = special.get(n)
            if i is not None:
                return int(i)
        return None

    special.update({v[0]: int(hf.token_to_id(v[0])) for v in named.values()})

    bos = find((*named.get("bos_token", ()), "<|bos|>", "<s>", "<|begin_of_text|>", "<|endoftext|>"))
    eos = find((*named.get("eos_token", ()), "<|eos|>", "</s>", "<|end_of_text|>", "<|endoftext|>"))
    if bos is None or eos is None:
        raise DataConfigError(
            f"tokenizer {str(file)!r} has no BOS/EOS token; accepted names: <|bos|>/<|eos|>, "
            "<s>/</s>, <|endoftext|> (or list them in tokenizer_config.json special_tokens)"
        )
    pad = find((*named.get("pad_token", ()), "<|pad|>", "<pad>"))
    pad_id = eos if pad is None else pad
    skip = None if flagged is None else frozenset(flagged | {bos, eos, pad_id})
    return Tokenizer(hf=hf, pad_id=pad_id, bos_id=bos, eos_id=eos, special=special, source=file.parent, skip_ids=skip)


def _encode_only(file: Path) -> tuple[Any, frozenset[int]]:
    """(tokenizers.Tokenizer with every added token special and not matched in text, the ids of the
    added tokens the file itself flags special). Marking them all special matters: DeepSeek's
    tokenizer.json has non-special added tokens (`<｜User｜>`, `<｜tool▁calls▁begin｜>`) that
    `encode_special_tokens` alone would still match inside a document."""
    from tokenizers import Tokenizer as HFTokenizer

    try:
        data = json.loads(file.read_text())
        added = data.get("added_tokens") or []
        flagged = frozenset(int(t["id"]) for t in added if t.get("special"))
        for t in added:
            t["special"] = True
        hf = HFTokenizer.from_str(json.dumps(data))
    except Exception as e:  # malformed JSON, or tokenizers' bare Exception on a bad model
        raise DataConfigError(f"tokenizer {str(file)!r} could not be read: {e}") from None
    hf.encode_special_tokens = True  # special-token strings in document text are plain bytes
    return hf, flagged


# --------------------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------------------


def train_tokenizer(texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 style pre-tokenisation, no prefix space) with SPECIAL_TOKENS
    at ids 0..6. The 256 byte symbols are always in the vocabulary, so any text round-trips."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise DataConfigError(
            f"--vocab-size {vocab_size} is too small: a byte-level BPE needs at least "
            f"{256 + len(SPECIAL_TOKENS)} (256 bytes + {len(SPECIAL_TOKENS)} special tokens)"
        )
    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    hf.train_from_iterator(texts, trainer=trainer)
    hf.encode_special_tokens = True
    ids: dict[str, int] = {}
    for t in SPECIAL_TOKENS:
        token_id = hf.token_to_id(t)
        if token_id is None:  # the trainer adds every special token; a tokenizers change would show here
            raise RuntimeError(f"the trained tokenizer has no id for special token {t!r}")
        ids[t] = token_id
    return Tokenizer(hf=hf, pad_id=ids["<|pad|>"], bos_id=ids["<|bos|>"], eos_id=ids["<|eos|>"], special=ids)


def save_tokenizer(tok: Tokenizer, out_dir: str | Path) -> Path:
    """Write tokenizer.json and tokenizer_config.json (special ids + chat template name) to out_dir."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.hf.save(str(out / "tokenizer.json"), pretty=False)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|bos|>",
        "eos_token": "<|eos|>",
        "pad_token": "<|pad|>",
        "special_tokens": dict(sorted(tok.special.items(), key=lambda kv: kv[1])),
        "chat_template_name": CHAT_TEMPLATE_NAME,
        "chat_template_doc": "see composer_jax/formats/chatml.py and docs/data.md",
        "vocab_size": tok.vocab_size,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1) + "\n")
    return out
