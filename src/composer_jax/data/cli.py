"""`composer-jax data ...`: offline data tools.

data make-sft --tasks tasks/ --out assets/sft/train.jsonl   SFT conversations from Harbor tasks
    (a generated family: `composer-jax env generate set-constant --seeds 0:256 --out DIR` first)
data peek --config CFG [--seq-len N --batch-size B]         print one packed batch, decoded (chat:
    first, which tools each source's first rows render with: their own, the session's or none)
"""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from composer_jax.config import ConfigError, DataConfigError
from composer_jax.errors import UsageError

if TYPE_CHECKING:
    from composer_jax.config import SourceConfig
    from composer_jax.formats.tokenizer import Tokenizer


def _peek(args: argparse.Namespace) -> None:
    from pathlib import Path

    import numpy as np

    from composer_jax.config import DataConfig, build_dataclass, read_yaml
    from composer_jax.data.pipeline import make_train_iterator
    from composer_jax.formats.tokenizer import load_tokenizer

    raw = read_yaml(Path(args.config).resolve())
    cfg = build_dataclass(DataConfig, raw.get("data", raw), "data")
    batch = next(make_train_iterator(cfg, seq_len=args.seq_len, batch_size=args.batch_size, seed=0))
    tok = load_tokenizer(cfg.tokenizer)
    if cfg.format == "chat":
        for src in cfg.sources:
            _peek_tools(src, tok, args.rows)
    for r in range(batch["tokens"].shape[0]):
        seg = batch["segment_ids"][r]
        print(
            f"--- row {r}: {int(seg.max())} segments, {int((seg > 0).sum())}/{seg.size} tokens, "
            f"{int(batch['loss_mask'][r].sum())} targets"
        )
        for s in np.unique(seg[seg > 0]):
            print(f"[segment {s}] {tok.decode(batch['tokens'][r][seg == s])[: args.chars]!r}")


def _peek_tools(src: SourceConfig, tok: Tokenizer, rows: int) -> None:
    """Which tools the first `rows` rows of a chat source render with (pipeline.row_tools), with their
    ids, and how many of its first hundred rows carry their own."""
    from composer_jax.data.pipeline import row_tools
    from composer_jax.data.sources import ChatDocument, open_source
    from composer_jax.formats.chat_format import chat_format

    chat = chat_format(tok)
    docs = open_source(src, "messages")
    scanned = [d for d in (docs[i] for i in range(min(len(docs), 100))) if isinstance(d, ChatDocument)]
    own = sum(d.tools is not None for d in scanned)
    print(
        f"--- tools of {src.label}: a row's own `tools` where it carries them, else the session's; "
        f"{own} of its first {len(scanned)} rows carry their own"
    )
    for i, doc in enumerate(scanned[:rows]):
        tools, whose = row_tools(doc, chat)
        names = ", ".join(t["function"]["name"] for t in tools or ())
        said = {
            "row": f"its own tools ({len(tools or ())}): {names or '[]'}",
            "session": f"the session's tools ({len(tools or ())}): {names}",
            "none": f"no tools ({chat.name} takes no session tools)",
        }[whose]
        ids, mask = chat.conversation(doc.messages, tools=tools, where=f"{src.label} row {i}")
        print(f"[row {i}] {said}; {len(ids)} ids, {int(mask.sum())} targets")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="composer-jax data", description="offline data tools")
    sub = parser.add_subparsers(dest="cmd", required=True)
    ms = sub.add_parser("make-sft", help="SFT conversations (JSONL) from Harbor tasks' reference solutions")
    ms.add_argument(
        "--tasks",
        required=True,
        help="directory of task directories (instruction.md, environment/app, solution/solve.sh)",
    )
    ms.add_argument("--out", required=True, help="output JSONL file")
    ms.add_argument("--timeout", type=float, default=60.0, help="seconds per solve.sh run")
    pk = sub.add_parser("peek", help="print the first packed training batch of a config, decoded")
    pk.add_argument("--config", required=True, help="YAML with a data: section (or a bare DataConfig mapping)")
    pk.add_argument("--seq-len", type=int, default=256)
    pk.add_argument("--batch-size", type=int, default=2)
    pk.add_argument("--chars", type=int, default=200, help="characters of each segment to print")
    pk.add_argument("--rows", type=int, default=3, help="chat: rows per source whose tools are printed")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        if args.cmd == "make-sft":
            from composer_jax.data.sft import make_sft

            skipped: list[str] = []
            n = make_sft(args.tasks, args.out, timeout_s=args.timeout, skipped=skipped)
            for reason in skipped:
                print(f"composer-jax data: skipped {reason}", file=sys.stderr)
            print(f"wrote {n} conversations to {args.out}")
        else:
            _peek(args)
    except (ConfigError, DataConfigError, OSError) as e:
        raise UsageError(str(e)) from e
    return 0
