"""`composer-jax tokenizer train|encode`: train a byte-level BPE on a code corpus, or show a text's ids.

Walking a corpus is a data-pipeline concern (`data/sources.py`'s filters), so the command lives here;
the tokenizer itself is `formats/tokenizer.py`.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from composer_jax.config.data import DEFAULT_CODE_EXTENSIONS, DataConfigError
from composer_jax.data.sources import list_directory_files
from composer_jax.errors import UsageError
from composer_jax.formats.tokenizer import load_tokenizer, save_tokenizer, train_tokenizer


def iter_corpus_texts(
    paths: Sequence[str | Path], include: Sequence[str] = DEFAULT_CODE_EXTENSIONS, max_file_bytes: int = 1_000_000
) -> Iterator[str]:
    """Texts of the files under `paths` (directories are walked with the directory-source filters
    and de-duplicated by content; files are taken as given), in sorted order."""
    for p in map(Path, paths):
        if p.is_dir():
            for rel in list_directory_files(p, include=include, exclude=(), max_file_bytes=max_file_bytes):
                yield (p / rel).read_text(encoding="utf-8")
        elif p.is_file():
            yield p.read_text(encoding="utf-8", errors="replace")
        else:
            raise DataConfigError(f"corpus path {str(p)!r} does not exist; give files or directories")


def main(argv: list[str] | None = None) -> int:
    """`composer-jax tokenizer train|encode ...`."""
    parser = argparse.ArgumentParser(
        prog="composer-jax tokenizer", description="train or try a byte-level BPE tokenizer"
    )
    sub = parser.add_subparsers(dest="cmd", required=True)
    tr = sub.add_parser("train", help="train a byte-level BPE on code files and write tokenizer.json")
    tr.add_argument("--corpus", nargs="+", required=True, help="directories (walked, filtered) and/or files")
    tr.add_argument("--vocab-size", type=int, default=2048)
    tr.add_argument("--out", required=True, help="output directory")
    tr.add_argument(
        "--include",
        default=",".join(DEFAULT_CODE_EXTENSIONS),
        help="comma-separated extensions or globs for directories (default: common code files)",
    )
    tr.add_argument("--min-frequency", type=int, default=2)
    en = sub.add_parser("encode", help="print the token ids and pieces of a text")
    en.add_argument("--tokenizer", default="assets/tokenizer")
    en.add_argument("text")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        if args.cmd == "train":
            include = tuple(s for s in args.include.split(",") if s)
            texts = list(iter_corpus_texts(args.corpus, include=include))
            if not texts:
                raise DataConfigError(f"no corpus files found under {args.corpus} with include={include}")
            tok = train_tokenizer(texts, args.vocab_size, min_frequency=args.min_frequency)
            out = save_tokenizer(tok, args.out)
            n = sum(len(t) for t in texts)
            ntok = sum(len(ids) for ids in tok.encode_batch(texts))
            print(
                f"trained vocab {tok.vocab_size} on {len(texts)} files ({n} chars, {n / max(ntok, 1):.2f} "
                f"chars/token) -> {out}"
            )
        else:
            tok = load_tokenizer(args.tokenizer)
            ids = tok.encode(args.text)
            print(json.dumps({"ids": ids, "pieces": [tok.decode([i]) for i in ids]}, ensure_ascii=False))
    except (DataConfigError, OSError) as e:
        raise UsageError(str(e)) from e
    return 0
