"""`composer-jax data ...`: offline data tools.

data make-sft --tasks tasks/ --out assets/sft/train.jsonl   SFT conversations from Harbor tasks
    (a generated family: `composer-jax env generate set-constant --seeds 0:256 --out DIR` first)
data peek --config CFG [--seq-len N --batch-size B]         print one packed batch, decoded
"""

from __future__ import annotations

import argparse
import sys

from composer_jax.config import ConfigError, DataConfigError
from composer_jax.errors import UsageError


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
    for r in range(batch["tokens"].shape[0]):
        seg = batch["segment_ids"][r]
        print(
            f"--- row {r}: {int(seg.max())} segments, {int((seg > 0).sum())}/{seg.size} tokens, "
            f"{int(batch['loss_mask'][r].sum())} targets"
        )
        for s in np.unique(seg[seg > 0]):
            print(f"[segment {s}] {tok.decode(batch['tokens'][r][seg == s])[: args.chars]!r}")


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
