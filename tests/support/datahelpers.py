"""Helpers for the data and formats tests: the repository root, the data fixtures, small documents."""

import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "data" / "fixtures"


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def numbered_docs(n: int, prefix: str = "doc") -> list[str]:
    """Distinct short documents whose text says which one they are (decoded back in tests)."""
    return [f"{prefix} {i}: def f{i}(x):\n    return x + {i}\n" for i in range(n)]


def segments(batch: dict, tok) -> list[str]:
    """Decoded text of every segment of every row, BOS/EOS stripped."""
    out = []
    tokens = batch["tokens"].reshape(-1, batch["tokens"].shape[-1])
    seg = batch["segment_ids"].reshape(tokens.shape)
    for r in range(tokens.shape[0]):
        for s in sorted(set(seg[r][seg[r] > 0].tolist())):
            out.append(tok.decode(tokens[r][seg[r] == s], skip_special_tokens=True))
    return out
