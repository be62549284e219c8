"""argparse value types shared by the command-line tools (`serve`, `env-server`, the sampler's
flags): each error names the value given and what is accepted. No import beyond the standard library."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def int_at_least(low: int, *, none: bool = False, strict: bool = False) -> Callable[[str], int | None]:
    """An argparse `type` reading an integer >= `low` (> `low` when `strict`; with `none`, also
    "none" or "null": None)."""

    def parse(text: str) -> int | None:
        if none and text.lower() in ("none", "null"):
            return None
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r} is not an integer" + (" (or none, for no bound)" if none else "")
            ) from None
        if value < low or (strict and value == low):
            raise argparse.ArgumentTypeError(f"{value} must be {'>' if strict else '>='} {low}")
        return value

    return parse
