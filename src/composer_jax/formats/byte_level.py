"""GPT-2's byte-level alphabet: printable bytes stand for themselves, the others are shifted to code
points 256 and up, so every byte sequence is a string of vocabulary symbols (`tokenizers`'
ByteLevel pre-tokenizer and decoder use the same table)."""

from __future__ import annotations


def _table() -> dict[int, str]:
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, shift = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + shift)
            shift += 1
    return table


BYTE_TO_CHAR: dict[int, str] = _table()
CHAR_TO_BYTE: dict[str, int] = {c: b for b, c in BYTE_TO_CHAR.items()}
