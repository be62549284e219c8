"""Family implement-spec: implement a text-normalisation function whose spec varies by seed.

The workspace ``textkit`` has a stub ``normalize(s)``; the seed picks 2-5 ordered steps (strip,
case, collapse whitespace, replace, truncate, ...) with their parameters. The same steps are written
three ways from one source: as prose in the instruction and docs/normalize.md, as the reference
solution, and as the reference function in the hidden tests, so the three cannot disagree.
"""

from __future__ import annotations

import random

from .base import Family, TaskSpec, dedent

FAMILY = Family("implement-spec", "Implement a text normaliser whose ordered steps vary by seed.", "feature")


# A step is (op, params): _sentence says it in words for the spec, _code implements it on `s`.
def _ops(rng: random.Random) -> list[tuple[str, dict]]:
    pool = [
        "strip",
        "case",
        "collapse",
        "digits",
        "replace",
        "remove_chars",
        "truncate",
        "reverse_words",
        "dedupe_words",
        "title",
    ]
    n = rng.randint(3, 5)
    chosen = rng.sample(pool, n)
    if "case" in chosen and "title" in chosen:
        chosen.remove("title")
    # truncation, when present, is always last (so the length guarantee holds).
    if "truncate" in chosen:
        chosen.remove("truncate")
        chosen.append("truncate")
    ops = []
    for op in chosen:
        p: dict = {}
        if op == "case":
            p["mode"] = rng.choice(["lower", "upper"])
        elif op == "replace":
            p["old"], p["new"] = rng.choice(
                [("&", " and "), ("-", " "), ("_", "-"), ("@", " at "), ("+", " plus "), ("/", " or ")]
            )
        elif op == "remove_chars":
            p["chars"] = "".join(sorted(rng.sample(list("!?.,;:'\"()#*"), rng.randint(2, 5))))
        elif op == "truncate":
            p["n"] = rng.randint(12, 40)
        ops.append((op, p))
    return ops


def _sentence(op: str, p: dict) -> str:
    return {
        "strip": "strip leading and trailing whitespace",
        "case": f"convert to {p.get('mode')}case",
        "collapse": "collapse every run of whitespace characters into a single space",
        "digits": "delete all ASCII digits 0-9",
        "replace": f"replace every `{p.get('old')}` with `{p.get('new')}` (quotes not included)",
        "remove_chars": f"delete every occurrence of these characters: `{p.get('chars')}`",
        "truncate": (
            f"if longer than {p.get('n')} characters, cut it so that the result, ending in `...`, is exactly "
            f"{p.get('n')} characters long"
        ),
        "reverse_words": "split on whitespace, reverse the order of the words, join them with single spaces",
        "dedupe_words": (
            "split on whitespace, drop each word equal (case-sensitively) to the word before it, join "
            "with single spaces"
        ),
        "title": (
            "split on single spaces (`' '`), make each piece's first character uppercase and the rest "
            "lowercase, join with single spaces"
        ),
    }[op]


def _code(op: str, p: dict) -> str:
    return {
        "strip": "s = s.strip()",
        "case": f"s = s.{p.get('mode')}()",
        "collapse": 's = re.sub(r"\\s+", " ", s)',
        "digits": 's = re.sub(r"[0-9]", "", s)',
        "replace": f"s = s.replace({p.get('old')!r}, {p.get('new')!r})",
        "remove_chars": f's = "".join(c for c in s if c not in {p.get("chars")!r})',
        "truncate": f'if len(s) > {p.get("n")}:\n        s = s[:{p.get("n")} - 3] + "..."',
        "reverse_words": 's = " ".join(reversed(s.split()))',
        "dedupe_words": (
            'words = s.split()\n    s = " ".join(w for i, w in enumerate(words) if i == 0 or w != words[i - 1])'
        ),
        "title": 's = " ".join(w[:1].upper() + w[1:].lower() for w in s.split(" "))',
    }[op]


_TESTS = """\
import random
import re

import pytest

from textkit.normalize import normalize


def reference(s):
{ref_body}
    return s


FIXED = [
    "", "   ", "Hello World", "  Hello   World  ", "a&b-c_d@e+f/g", "x  x  X x x",
    "Numbers 123 and 4-5-6!", "  Mixed\\tTabs\\nand  newlines  ", "(quoted) \\"text\\"; more: stuff?",
    "the the the end end", "ALL CAPS SENTENCE, with: punctuation.", "a" * 60, "word " * 15,
    "R2-D2 & C-3PO @ home / away + more", "trailing space ", "'single' #hash *star*",
]

ALPHABET = "aAbBcCxyz 019 \\t&-_@+/!?.,;:'\\"()#*"


def random_inputs():
    rng = random.Random(1234)
    for _ in range(300):
        yield "".join(rng.choice(ALPHABET) for _ in range(rng.randint(0, 70)))


@pytest.mark.parametrize("text", FIXED)
def test_fixed_examples(text):
    assert normalize(text) == reference(text)


def test_random_inputs():
    for text in random_inputs():
        assert normalize(text) == reference(text), repr(text)


def test_returns_str():
    assert isinstance(normalize("abc"), str)
"""


def generate(rng: random.Random, seed: int) -> TaskSpec:
    ops = _ops(rng)
    steps = "\n".join(f"{i}. {_sentence(op, p)[0].upper()}{_sentence(op, p)[1:]}." for i, (op, p) in enumerate(ops, 1))
    body = "\n".join("    " + _code(op, p) for op, p in ops)
    stub = dedent('''
        """Normalisation of free-text labels before they are stored."""
        import re  # noqa: F401  (handy for the implementation)


        def normalize(s: str) -> str:
            """Normalise a label; see docs/normalize.md for the exact steps."""
            raise NotImplementedError
        ''')
    impl = (
        dedent('''
        """Normalisation of free-text labels before they are stored."""
        import re


        def normalize(s: str) -> str:
            """Normalise a label; see docs/normalize.md for the exact steps."""
        ''')
        + body
        + "\n    return s\n"
    )
    app = {
        "textkit/__init__.py": (
            '"""textkit: label utilities."""\nfrom .normalize import normalize\nfrom .labels import Label\n'
        ),
        "textkit/normalize.py": stub,
        "textkit/labels.py": dedent('''
            """Labels attached to catalogue entries."""
            from dataclasses import dataclass

            from .normalize import normalize


            @dataclass(frozen=True)
            class Label:
                raw: str

                @property
                def key(self) -> str:
                    return normalize(self.raw)
            '''),
        "docs/normalize.md": "# normalize(s)\n\nApply these steps, in this order:\n\n" + steps + "\n",
    }
    intro = rng.choice(
        [
            "Implement `textkit.normalize.normalize`. The steps, in order:",
            "`normalize()` in textkit is still a stub; implement it. It must apply, in order:",
            "Please write `normalize(s)` (textkit/normalize.py). Spec, applied in this order:",
        ]
    )
    instr = f"{intro}\n\n{steps}\n"
    return TaskSpec(
        instruction=instr,
        app=app,
        tests={"test_outputs.py": _TESTS.format(ref_body=body)},
        solution={"textkit/normalize.py": impl},
        difficulty="easy" if len(ops) <= 3 else "medium",
        category="feature",
        tags=["python", "feature", "strings", "spec"] + [op for op, _ in ops],
    )
