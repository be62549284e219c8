"""Parametrised task families: many small, learnable Harbor-format coding tasks from a seed.

The bundled suite under ``tasks/`` is hand-written; this module *generates* tasks for the RL demo,
where many variants of a few kinds of task are wanted. Every generated task follows the same
contract as the bundled ones (Harbor layout)::

    TASK_ID/
      task.toml              version, [metadata], [verifier], [agent], [environment]
      instruction.md         terse user request
      environment/Dockerfile
      environment/app/...    initial workspace (mounted at /app)
      tests/test.sh          verifier: cwd /app, /tests read-only, writes /logs/verifier/reward.txt
      tests/test_outputs.py  hidden tests (pytest)
      solution/solve.sh      reference change: cwd /app, /solution read-only

API::

    FAMILIES: dict[str, Family]
    generate_task(family, seed, dest) -> Path   # writes dest/<family>-<seed>/ and returns it

Generation is deterministic: the same (family, seed) gives a byte-identical task directory.
Standard library only (the environment server runs without JAX).
"""
from __future__ import annotations

import dataclasses
import json
import pathlib
import random
import shutil
import textwrap

__all__ = ["Family", "FAMILIES", "generate_task", "task_id_for", "TEST_SH", "DOCKERFILE"]


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    description: str
    kind: str  # debugging | feature | refactor | devops | tests | ...


# ----------------------------------------------------------------------------------------------
# Shared task boilerplate (also used verbatim by the bundled suite under tasks/).

DOCKERFILE = """\
FROM python:3.11-slim
WORKDIR /app
RUN pip install --no-cache-dir pytest
COPY app/ /app/
"""

TEST_SH = """\
#!/usr/bin/env bash
# Verifier: runs with cwd /app; hidden tests at /tests (read-only); results in /logs/verifier.
mkdir -p /logs/verifier
cd /app || { echo 0 > /logs/verifier/reward.txt; exit 0; }
export PYTHONPATH=/app
export PYTHONDONTWRITEBYTECODE=1
python3 -m pytest -q -p no:cacheprovider --rootdir=/tests \\
    --junitxml=/logs/verifier/junit.xml /tests
if [ $? -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
exit 0
"""

SOLVE_SH_COPY = """\
#!/usr/bin/env bash
# Reference solution: copy the changed files over the workspace.
set -euo pipefail
cp -r /solution/app/. /app/
"""


def _task_toml(*, difficulty: str, category: str, tags: list[str], agent_timeout: int = 600) -> str:
    tag_list = ", ".join(json.dumps(t) for t in tags)
    return (
        'version = "1.0"\n\n'
        "[metadata]\n"
        'author_name = "composer_jax task families"\n'
        f'difficulty = "{difficulty}"\n'
        f'category = "{category}"\n'
        f"tags = [{tag_list}]\n\n"
        "[verifier]\ntimeout_sec = 60.0\n\n"
        f"[agent]\ntimeout_sec = {float(agent_timeout)}\n\n"
        "[environment]\nbuild_timeout_sec = 300.0\ncpus = 1\nmemory_mb = 1024\nstorage_mb = 1024\n"
    )


@dataclasses.dataclass
class _Spec:
    instruction: str
    app: dict[str, str]
    tests: dict[str, str]
    solution: dict[str, str]  # files copied over /app by solve.sh (paths relative to /app)
    difficulty: str
    category: str
    tags: list[str]
    solve_sh: str = SOLVE_SH_COPY


def _dedent(s: str) -> str:
    return textwrap.dedent(s).lstrip("\n")


def _write(path: pathlib.Path, text: str, executable: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode("utf-8"))
    path.chmod(0o755 if executable else 0o644)


def _materialise(spec: _Spec, root: pathlib.Path) -> None:
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    _write(root / "task.toml", _task_toml(difficulty=spec.difficulty, category=spec.category, tags=spec.tags))
    _write(root / "instruction.md", spec.instruction.rstrip("\n") + "\n")
    _write(root / "environment" / "Dockerfile", DOCKERFILE)
    for rel, text in sorted(spec.app.items()):
        _write(root / "environment" / "app" / rel, text)
    _write(root / "tests" / "test.sh", TEST_SH, executable=True)
    for rel, text in sorted(spec.tests.items()):
        _write(root / "tests" / rel, text)
    _write(root / "solution" / "solve.sh", spec.solve_sh, executable=True)
    for rel, text in sorted(spec.solution.items()):
        _write(root / "solution" / "app" / rel, text)


def _rng(family: str, seed: int) -> random.Random:
    return random.Random(f"composer_jax.task_families:{family}:{seed}")


# ----------------------------------------------------------------------------------------------
# Family 1: off-by-one -- one boundary bug planted in one of several small sequence helpers.

_OBO_FUNCS: dict[str, dict] = {
    "chunk": {
        "doc": "Split seq into consecutive lists of `size` items; the last one may be shorter.",
        "sig": "chunk(seq, size)",
        "ok": "return [list(seq[i:i + size]) for i in range(0, len(seq), size)]",
        "bugs": [
            "return [list(seq[i:i + size]) for i in range(0, len(seq) - 1, size)]",
            "return [list(seq[i:i + size - 1]) for i in range(0, len(seq), size)]",
        ],
        "examples": ["chunk([1, 2, 3, 4, 5], 2)", "chunk(list(range(7)), 3)", "chunk('abcde', 2)"],
    },
    "page": {
        "doc": "Return page `number` (1-based) of items, `per_page` items per page.",
        "sig": "page(items, number, per_page=PER_PAGE)",
        "ok": "start = (number - 1) * per_page\n    return list(items[start:start + per_page])",
        "bugs": [
            "start = number * per_page\n    return list(items[start:start + per_page])",
            "start = (number - 1) * per_page\n    return list(items[start:start + per_page + 1])",
        ],
        "examples": ["page(list(range(1, 31)), 2)", "page(list(range(50)), 1, 4)", "page('abcdefghij', 2, 3)"],
    },
    "moving_sums": {
        "doc": "Sums of every window of `k` consecutive numbers in xs (len(xs) - k + 1 windows).",
        "sig": "moving_sums(xs, k)",
        "ok": "return [sum(xs[i:i + k]) for i in range(len(xs) - k + 1)]",
        "bugs": [
            "return [sum(xs[i:i + k]) for i in range(len(xs) - k)]",
            "return [sum(xs[i:i + k - 1]) for i in range(len(xs) - k + 1)]",
        ],
        "examples": ["moving_sums([1, 2, 3, 4], 2)", "moving_sums([5, 1, 4, 2, 8], 3)", "moving_sums([3, 3, 3], 3)"],
    },
    "count_between": {
        "doc": "Count the x in xs with lo <= x <= hi (both ends inclusive).",
        "sig": "count_between(xs, lo, hi)",
        "ok": "return sum(1 for x in xs if lo <= x <= hi)",
        "bugs": [
            "return sum(1 for x in xs if lo <= x < hi)",
            "return sum(1 for x in xs if lo < x <= hi)",
        ],
        "examples": ["count_between([1, 5, 10, 15], 5, 10)", "count_between(list(range(20)), 3, 7)", "count_between([2, 2, 9], 2, 9)"],
    },
    "last": {
        "doc": "The last `n` items of xs as a list (n == 0 gives [], n > len(xs) gives all).",
        "sig": "last(xs, n)",
        "ok": "return list(xs[max(len(xs) - n, 0):]) if n > 0 else []",
        "bugs": [
            "return list(xs[-n:])",
            "return list(xs[max(len(xs) - n + 1, 0):]) if n > 0 else []",
        ],
        "examples": ["last([1, 2, 3, 4], 2)", "last([1, 2, 3], 0)", "last('abcdef', 3)"],
    },
    "nearest_rank": {
        "doc": "Nearest-rank percentile p (0 < p <= 100) of an ascending list: the item at 1-based rank ceil(p/100*n).",
        "sig": "nearest_rank(sorted_xs, p)",
        "ok": "rank = math.ceil(p / 100 * len(sorted_xs))\n    return sorted_xs[max(rank, 1) - 1]",
        "bugs": [
            "rank = math.ceil(p / 100 * len(sorted_xs))\n    return sorted_xs[min(rank, len(sorted_xs) - 1)]",
            "rank = int(p / 100 * len(sorted_xs))\n    return sorted_xs[max(rank, 1) - 1]",
        ],
        "examples": ["nearest_rank([10, 20, 30, 40, 50], 50)", "nearest_rank(list(range(1, 11)), 95)", "nearest_rank([1, 2, 3], 100)"],
    },
}

_OBO_TESTS = '''\
import math
import random

import pytest

PER_PAGE = {per_page}


def ref_chunk(seq, size):
    return [list(seq[i:i + size]) for i in range(0, len(seq), size)]


def ref_page(items, number, per_page=PER_PAGE):
    start = (number - 1) * per_page
    return list(items[start:start + per_page])


def ref_moving_sums(xs, k):
    return [sum(xs[i:i + k]) for i in range(len(xs) - k + 1)]


def ref_count_between(xs, lo, hi):
    return sum(1 for x in xs if lo <= x <= hi)


def ref_last(xs, n):
    return list(xs[max(len(xs) - n, 0):]) if n > 0 else []


def ref_nearest_rank(sorted_xs, p):
    rank = math.ceil(p / 100 * len(sorted_xs))
    return sorted_xs[max(rank, 1) - 1]


def cases(seed):
    rng = random.Random(seed)
    for _ in range(200):
        n = rng.randint(0, 23)
        yield [rng.randint(-20, 20) for _ in range(n)]


def test_package_exports_all_helpers():
    import rangekit
    for name in ["chunk", "page", "moving_sums", "count_between", "last", "nearest_rank"]:
        assert callable(getattr(rangekit, name)), name


def test_chunk():
    from rangekit import chunk
    for xs in cases(1):
        for size in (1, 2, 3, 5, 8):
            assert chunk(xs, size) == ref_chunk(xs, size), (xs, size)


def test_page():
    from rangekit import page
    for xs in cases(2):
        for number in (1, 2, 3, 4):
            assert page(xs, number) == ref_page(xs, number), (xs, number)
            for pp in (1, 3, 7):
                assert page(xs, number, pp) == ref_page(xs, number, pp), (xs, number, pp)


def test_moving_sums():
    from rangekit import moving_sums
    for xs in cases(3):
        for k in range(1, len(xs) + 1):
            assert moving_sums(xs, k) == ref_moving_sums(xs, k), (xs, k)


def test_count_between():
    from rangekit import count_between
    for xs in cases(4):
        for lo, hi in [(-5, 5), (0, 0), (3, 12), (-20, 20), (7, 2)]:
            assert count_between(xs, lo, hi) == ref_count_between(xs, lo, hi), (xs, lo, hi)


def test_last():
    from rangekit import last
    for xs in cases(5):
        for n in range(0, len(xs) + 3):
            assert last(xs, n) == ref_last(xs, n), (xs, n)


def test_nearest_rank():
    from rangekit import nearest_rank
    for xs in cases(6):
        if not xs:
            continue
        xs = sorted(xs)
        for p in (1, 10, 25, 33.3, 50, 66, 75, 90, 95, 99, 100):
            assert nearest_rank(xs, p) == ref_nearest_rank(xs, p), (xs, p)
'''


def _obo_module(funcs: list[str], bug: tuple[str, int] | None, per_page: int) -> str:
    parts = ['"""Small sequence helpers."""\n', "import math\n\n", f"PER_PAGE = {per_page}\n"]
    for name in funcs:
        f = _OBO_FUNCS[name]
        body = f["bugs"][bug[1]] if bug is not None and bug[0] == name else f["ok"]
        parts.append(f'\n\ndef {f["sig"]}:\n    """{f["doc"]}"""\n    {body}\n')
    return "".join(parts)


def _gen_off_by_one(rng: random.Random, seed: int) -> _Spec:
    names = list(_OBO_FUNCS)
    target = rng.choice(names)
    bug_idx = rng.randrange(len(_OBO_FUNCS[target]["bugs"]))
    per_page = rng.choice([4, 5, 8, 10, 20, 25])
    order = names[:]
    rng.shuffle(order)
    split = rng.randint(2, 4)
    files = {"rangekit/seqs.py": order[:split], "rangekit/numeric.py": order[split:]}

    def render(bug):
        out = {}
        for rel, fs in files.items():
            out[rel] = _obo_module(fs, bug, per_page)
        return out

    app = render((target, bug_idx))
    fixed = render(None)
    app["rangekit/__init__.py"] = (
        '"""rangekit: boundary-safe sequence helpers."""\n'
        f"from .seqs import {', '.join(sorted(files['rangekit/seqs.py']))}\n"
        f"from .numeric import {', '.join(sorted(files['rangekit/numeric.py']))}\n"
    )
    app["README.md"] = "# rangekit\n\nTiny sequence helpers used by the reporting jobs.\n"
    # A failing example for the instruction, evaluated with the buggy and the fixed code.
    env_ok: dict = {}
    env_bug: dict = {}
    target_file = next(rel for rel, fs in files.items() if target in fs)
    exec(compile(fixed[target_file], "<ok>", "exec"), env_ok)
    exec(compile(app[target_file], "<bug>", "exec"), env_bug)
    examples = _OBO_FUNCS[target]["examples"][:]
    rng.shuffle(examples)
    example = examples[0]
    for ex in examples:
        if eval(ex, env_ok) != eval(ex, env_bug):
            example = ex
            break
    good, bad = eval(example, env_ok), eval(example, env_bug)
    style = rng.randrange(3)
    if style == 0:
        instr = f"`{example}` returns `{bad!r}` but should return `{good!r}`. Fix the bug in rangekit."
    elif style == 1:
        instr = (f"rangekit.{target} has an edge-case bug: `{example}` gives `{bad!r}`, expected `{good!r}`. "
                 "Fix it; keep the other helpers as they are.")
    else:
        instr = (f"Reports are off by one. Traced it to rangekit: `{example}` -> `{bad!r}` (want `{good!r}`). "
                 "Please fix.")
    return _Spec(
        instruction=instr,
        app=app,
        tests={"test_outputs.py": _OBO_TESTS.format(per_page=per_page)},
        solution={target_file: fixed[target_file]},
        difficulty="easy",
        category="debugging",
        tags=["python", "bugfix", "off-by-one", target],
    )


# ----------------------------------------------------------------------------------------------
# Family 2: implement-spec -- implement a text-normalisation function whose spec varies by seed.

# op -> (parameter sampler, spec sentence, implementation line(s) operating on `s`)
def _spec_ops(rng: random.Random) -> list[tuple[str, dict]]:
    pool = ["strip", "case", "collapse", "digits", "replace", "remove_chars", "truncate", "reverse_words",
            "dedupe_words", "title"]
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
            p["old"], p["new"] = rng.choice([("&", " and "), ("-", " "), ("_", "-"), ("@", " at "), ("+", " plus "),
                                             ("/", " or ")])
        elif op == "remove_chars":
            p["chars"] = "".join(sorted(rng.sample(list("!?.,;:'\"()#*"), rng.randint(2, 5))))
        elif op == "truncate":
            p["n"] = rng.randint(12, 40)
        ops.append((op, p))
    return ops


def _spec_sentence(op: str, p: dict) -> str:
    return {
        "strip": "strip leading and trailing whitespace",
        "case": f"convert to {p.get('mode')}case",
        "collapse": "collapse every run of whitespace characters into a single space",
        "digits": "delete all ASCII digits 0-9",
        "replace": f"replace every `{p.get('old')}` with `{p.get('new')}` (quotes not included)",
        "remove_chars": f"delete every occurrence of these characters: `{p.get('chars')}`",
        "truncate": (f"if longer than {p.get('n')} characters, cut it so that the result, ending in `...`, is exactly "
                     f"{p.get('n')} characters long"),
        "reverse_words": "split on whitespace, reverse the order of the words, join them with single spaces",
        "dedupe_words": ("split on whitespace, drop each word equal (case-sensitively) to the word before it, join "
                         "with single spaces"),
        "title": ("split on single spaces (`' '`), make each piece's first character uppercase and the rest "
                  "lowercase, join with single spaces"),
    }[op]


def _spec_code(op: str, p: dict) -> str:
    return {
        "strip": "s = s.strip()",
        "case": f"s = s.{p.get('mode')}()",
        "collapse": "s = re.sub(r\"\\s+\", \" \", s)",
        "digits": "s = re.sub(r\"[0-9]\", \"\", s)",
        "replace": f"s = s.replace({p.get('old')!r}, {p.get('new')!r})",
        "remove_chars": f"s = \"\".join(c for c in s if c not in {p.get('chars')!r})",
        "truncate": f"if len(s) > {p.get('n')}:\n        s = s[:{p.get('n')} - 3] + \"...\"",
        "reverse_words": "s = \" \".join(reversed(s.split()))",
        "dedupe_words": ("words = s.split()\n    s = \" \".join(w for i, w in enumerate(words) "
                         "if i == 0 or w != words[i - 1])"),
        "title": "s = \" \".join(w[:1].upper() + w[1:].lower() for w in s.split(\" \"))",
    }[op]


_SPEC_TESTS = '''\
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
'''


def _gen_implement_spec(rng: random.Random, seed: int) -> _Spec:
    ops = _spec_ops(rng)
    steps = "\n".join(f"{i}. {_spec_sentence(op, p)[0].upper()}{_spec_sentence(op, p)[1:]}."
                      for i, (op, p) in enumerate(ops, 1))
    body = "\n".join("    " + _spec_code(op, p) for op, p in ops)
    stub = _dedent('''
        """Normalisation of free-text labels before they are stored."""
        import re  # noqa: F401  (handy for the implementation)


        def normalize(s: str) -> str:
            """Normalise a label; see docs/normalize.md for the exact steps."""
            raise NotImplementedError
        ''')
    impl = _dedent('''
        """Normalisation of free-text labels before they are stored."""
        import re


        def normalize(s: str) -> str:
            """Normalise a label; see docs/normalize.md for the exact steps."""
        ''') + body + "\n    return s\n"
    app = {
        "textkit/__init__.py": '"""textkit: label utilities."""\nfrom .normalize import normalize\nfrom .labels import Label\n',
        "textkit/normalize.py": stub,
        "textkit/labels.py": _dedent('''
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
    intro = rng.choice([
        "Implement `textkit.normalize.normalize`. The steps, in order:",
        "`normalize()` in textkit is still a stub; implement it. It must apply, in order:",
        "Please write `normalize(s)` (textkit/normalize.py). Spec, applied in this order:",
    ])
    instr = f"{intro}\n\n{steps}\n"
    return _Spec(
        instruction=instr,
        app=app,
        tests={"test_outputs.py": _SPEC_TESTS.format(ref_body=body)},
        solution={"textkit/normalize.py": impl},
        difficulty="easy" if len(ops) <= 3 else "medium",
        category="feature",
        tags=["python", "feature", "strings", "spec"] + [op for op, _ in ops],
    )


# ----------------------------------------------------------------------------------------------
# Family 3: rename-api -- rename a function across a small package, with or without a shim.

_RENAME_TARGETS = {
    "calc_total": {
        "new": ["compute_total", "order_total", "sum_lines"],
        "src": ('def {name}(lines):\n'
                '    """Total in cents of (qty, unit_cents) lines."""\n'
                '    return sum(qty * unit for qty, unit in lines)\n'),
        "use": "{ref}(lines)",
        "check": ("[(2, 150), (1, 999), (3, 5)]", 2*150 + 999 + 15),
    },
    "apply_discount": {
        "new": ["discounted", "with_discount", "reduce_by_percent"],
        "src": ('def {name}(cents, percent):\n'
                '    """Cents after a percentage discount, rounded half up."""\n'
                '    return (cents * (100 - percent) + 50) // 100\n'),
        "use": "{ref}(sum(q * u for q, u in lines), 10)",
        "check": ("1999, 15", (1999 * 85 + 50) // 100),
    },
    "fmt_money": {
        "new": ["format_cents", "money_str", "render_amount"],
        "src": ('def {name}(cents):\n'
                '    """Render cents as a dollar string, e.g. 1234 -> \'$12.34\'."""\n'
                '    sign = "-" if cents < 0 else ""\n'
                '    cents = abs(cents)\n'
                '    return f"{{sign}}${{cents // 100:,}}.{{cents % 100:02d}}"\n'),
        "use": "{ref}(sum(q * u for q, u in lines))",
        "check": ("-123456", "-$1,234.56"),
    },
}

_RENAME_CALLERS = ["cart", "checkout", "invoice", "report"]

_RENAME_TESTS = '''\
import ast
import pathlib
import warnings

import pytest

OLD, NEW, KEEP_ALIAS = {old!r}, {new!r}, {keep!r}
CALLERS = {callers!r}
EXPECTED = {expected!r}
PKG = pathlib.Path("/app/shopcore")


def names_in(path):
    tree = ast.parse(path.read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == OLD:
            found.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr == OLD:
            found.append(node.lineno)
        elif isinstance(node, ast.alias) and (node.name == OLD or node.asname == OLD):
            found.append(getattr(node, "lineno", 0))
        elif isinstance(node, ast.FunctionDef) and node.name == OLD:
            found.append(node.lineno)
    return found


def test_new_name_works():
    from shopcore import pricing
    fn = getattr(pricing, NEW)
    assert fn({args}) == {check!r}


def test_callers_use_new_name():
    for path in sorted(PKG.glob("*.py")):
        if path.name == "pricing.py":
            continue
        assert names_in(path) == [], f"{{path.name}} still refers to {{OLD}}"
        if path.stem in CALLERS:
            src = path.read_text()
            assert NEW in src, f"{{path.name}} should call {{NEW}}"


def test_callers_behave_the_same():
    import importlib
    lines = [(2, 150), (1, 999), (3, 5), (4, 1250)]
    for mod in CALLERS:
        m = importlib.import_module(f"shopcore.{{mod}}")
        assert m.summarise(lines) == EXPECTED[mod], mod


def test_old_name_policy():
    from shopcore import pricing
    if KEEP_ALIAS:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            value = getattr(pricing, OLD)({args})
        assert value == {check!r}
        assert any(issubclass(w.category, DeprecationWarning) and NEW in str(w.message) for w in caught), \\
            "calling the old name must emit a DeprecationWarning that mentions the new name"
    else:
        assert not hasattr(pricing, OLD)
        assert OLD not in (PKG / "pricing.py").read_text()


def test_new_name_does_not_warn():
    from shopcore import pricing
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        getattr(pricing, NEW)({args})
'''


def _gen_rename_api(rng: random.Random, seed: int) -> _Spec:
    old = rng.choice(sorted(_RENAME_TARGETS))
    t = _RENAME_TARGETS[old]
    new = rng.choice(t["new"])
    keep = rng.random() < 0.5
    callers = sorted(rng.sample(_RENAME_CALLERS, rng.randint(2, 4)))
    others = [o for o in sorted(_RENAME_TARGETS) if o != old]

    def pricing(name: str, alias: bool) -> str:
        out = ['"""Pricing primitives (all amounts in integer cents)."""\n']
        if alias:
            out.append("import warnings\n")
        for fn in sorted(_RENAME_TARGETS):
            out.append("\n\n" + _RENAME_TARGETS[fn]["src"].format(name=name if fn == old else fn))
        if alias:
            out.append(f'\n\ndef {old}(*args, **kwargs):\n'
                       f'    """Deprecated alias of {name}."""\n'
                       f'    warnings.warn("{old} is deprecated; use {name}", DeprecationWarning, stacklevel=2)\n'
                       f'    return {name}(*args, **kwargs)\n')
        return "".join(out)

    def caller(mod: str, name: str, style: int) -> str:
        if style == 0:
            head = f"from .pricing import {name}\n"
            ref = name
        elif style == 1:
            head = "from . import pricing\n"
            ref = f"pricing.{name}"
        else:
            head = f"from .pricing import {name} as _price_fn\n"
            ref = "_price_fn"
        return (f'"""{mod.capitalize()} helpers."""\n{head}\n\n'
                f"def summarise(lines):\n"
                f'    """Summary value used by the {mod} view."""\n'
                f"    return {t['use'].format(ref=ref)}\n")

    app = {"shopcore/__init__.py": '"""shopcore: the pricing side of the shop."""\n',
           "shopcore/pricing.py": pricing(old, False)}
    sol = {"shopcore/pricing.py": pricing(new, keep)}
    env: dict = {}
    exec(compile(pricing(old, False), "<p>", "exec"), env)
    sample = [(2, 150), (1, 999), (3, 5), (4, 1250)]
    expected = {}
    for mod in _RENAME_CALLERS:
        if mod in callers:
            style = rng.randrange(3)
            app[f"shopcore/{mod}.py"] = caller(mod, old, style)
            sol[f"shopcore/{mod}.py"] = caller(mod, new, style)
            expected[mod] = eval(t["use"].format(ref=old), env, {"lines": sample})
        else:
            other = rng.choice(others)
            src = (f'"""{mod.capitalize()} helpers."""\nfrom . import pricing\n\n\n'
                   f"def summarise(lines):\n    return {_RENAME_TARGETS[other]['use'].format(ref='pricing.' + other)}\n")
            app[f"shopcore/{mod}.py"] = src
            expected[mod] = eval(_RENAME_TARGETS[other]["use"].format(ref=other), env, {"lines": sample})
    policy = (f"Keep `{old}` working as a deprecated alias that emits a `DeprecationWarning` pointing to `{new}`."
              if keep else f"Remove `{old}` entirely, no alias.")
    instr = rng.choice([
        f"Rename `shopcore.pricing.{old}` to `{new}` and update every caller in the package. {policy}",
        f"`{old}` is a bad name. Rename it to `{new}` everywhere in shopcore. {policy}",
    ])
    args, check = t["check"]
    tests = _RENAME_TESTS.format(old=old, new=new, keep=keep, callers=callers, expected=expected,
                                 args=args, check=check)
    return _Spec(instruction=instr, app=app, tests={"test_outputs.py": tests}, solution=sol,
                 difficulty="easy" if not keep else "medium", category="refactor",
                 tags=["python", "refactor", "rename", old])


# ----------------------------------------------------------------------------------------------
# Family 4: add-cli-flag -- add one or two options to a small argparse CLI.

_CLI_FLAGS = {
    "min_length": {"names": ["--min-length", "--min-len"], "kind": "int",
                   "say": "`{flag} N`: ignore words shorter than N characters (default: no limit)"},
    "ignore_case": {"names": ["--ignore-case", "--fold-case"], "kind": "bool",
                    "say": "`{flag}`: count words case-insensitively (report them lowercased)"},
    "exclude": {"names": ["--exclude", "--skip"], "kind": "list",
                "say": ("`{flag} WORD`: drop this word from the counts; may be given several times (compare after "
                        "case folding when that applies)")},
    "min_count": {"names": ["--min-count", "--at-least"], "kind": "int",
                  "say": "`{flag} N`: only list words that occur at least N times"},
    "json": {"names": ["--json"], "kind": "bool",
             "say": ("`{flag}`: print one JSON array of `[word, count]` pairs (same order) instead of the text "
                     "lines")},
}

_CLI_COUNTING = _dedent('''
    """Word counting primitives."""
    import re
    from collections import Counter

    WORD = re.compile(r"[A-Za-z']+")


    def tokenize(text):
        return WORD.findall(text)


    def count_words(words):
        return Counter(words)


    def top_words(counts, n):
        """The n most common (word, count) pairs: by count descending, then word ascending."""
        return sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:n]
    ''')


def _cli_source(top_default: int, flags: dict[str, str]) -> str:
    args = []
    pipeline = ["    words = tokenize(text)"]
    imports = ["import argparse", "import sys"]
    if "json" in flags:
        imports.insert(1, "import json")
    for key in ["ignore_case", "min_length", "exclude", "min_count", "json"]:
        if key not in flags:
            continue
        flag = flags[key]
        dest = flag.lstrip("-").replace("-", "_")
        kind = _CLI_FLAGS[key]["kind"]
        if kind == "int":
            default = "1" if key in ("min_length", "min_count") else "None"
            args.append(f'    parser.add_argument("{flag}", dest="{dest}", type=int, default={default},\n'
                        f'                        help="{key.replace("_", " ")} threshold")')
        elif kind == "bool":
            args.append(f'    parser.add_argument("{flag}", dest="{dest}", action="store_true",\n'
                        f'                        help="{key.replace("_", " ")}")')
        else:
            args.append(f'    parser.add_argument("{flag}", dest="{dest}", action="append", default=[],\n'
                        f'                        metavar="WORD", help="word to leave out (repeatable)")')
        if key == "ignore_case":
            pipeline.append(f"    if args.{dest}:\n        words = [w.lower() for w in words]")
        elif key == "min_length":
            pipeline.append(f"    words = [w for w in words if len(w) >= args.{dest}]")
        elif key == "exclude":
            fold = ("w.lower() if args.{} else w".format(flags["ignore_case"].lstrip("-").replace("-", "_"))
                    if "ignore_case" in flags else "w")
            pipeline.append(f"    excluded = {{{fold} for w in args.{dest}}}\n"
                            f"    words = [w for w in words if w not in excluded]")
    pipeline.append("    pairs = top_words(count_words(words), args.top)")
    if "min_count" in flags:
        dest = flags["min_count"].lstrip("-").replace("-", "_")
        pipeline[-1] = ("    counts = count_words(words)\n"
                        f"    counts = {{w: c for w, c in counts.items() if c >= args.{dest}}}\n"
                        "    pairs = top_words(counts, args.top)")
    if "json" in flags:
        pipeline.append("    if args.json:\n        print(json.dumps([[w, c] for w, c in pairs]))\n        return 0")
    pipeline.append('    for word, count in pairs:\n        print(f"{word} {count}")\n    return 0')
    return (
        '"""wordtool: print the most frequent words of a text file."""\n'
        + "\n".join(imports) + "\n\n"
        "from .counting import count_words, tokenize, top_words\n\n\n"
        "def build_parser():\n"
        '    parser = argparse.ArgumentParser(prog="wordtool", description=__doc__)\n'
        '    parser.add_argument("path", help="text file to read, or - for stdin")\n'
        f'    parser.add_argument("--top", type=int, default={top_default}, help="how many words to list")\n'
        + "".join(a + "\n" for a in args)
        + "    return parser\n\n\n"
        "def main(argv=None):\n"
        "    args = build_parser().parse_args(argv)\n"
        '    if args.path == "-":\n'
        "        text = sys.stdin.read()\n"
        "    else:\n"
        '        with open(args.path, encoding="utf-8") as fh:\n'
        "            text = fh.read()\n"
        + "\n".join(pipeline) + "\n"
    )


_CLI_TESTS = '''\
import json
import os
import subprocess
import sys
from collections import Counter
import re

import pytest

TOP = {top}
FLAGS = {flags!r}
TEXTS = [
    "the cat and the hat and The Cat sat on the mat",
    "It's a dog's life; a DOG, a dog! Life goes on. it's fine, it's FINE",
    "b a c b a b  x y z  xx yy zz xx yy xx " * 3,
    "One two three four five six seven eight nine ten eleven twelve " * 2 + "one ONE One",
    "",
]


def reference(text, top=TOP, ignore_case=False, min_length=1, exclude=(), min_count=1, as_json=False):
    words = re.findall(r"[A-Za-z']+", text)
    if ignore_case:
        words = [w.lower() for w in words]
    words = [w for w in words if len(w) >= min_length]
    ex = {{w.lower() if ignore_case else w for w in exclude}}
    words = [w for w in words if w not in ex]
    counts = {{w: c for w, c in Counter(words).items() if c >= min_count}}
    pairs = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:top]
    if as_json:
        return json.dumps([[w, c] for w, c in pairs]) + "\\n"
    return "".join(f"{{w}} {{c}}\\n" for w, c in pairs)


def run(tmp_path, text, *args):
    path = tmp_path / "input.txt"
    path.write_text(text, encoding="utf-8")
    env = dict(os.environ, PYTHONPATH="/app")
    proc = subprocess.run([sys.executable, "-m", "wordtool", str(path), *args], cwd="/app", env=env,
                          capture_output=True, text=True, timeout=20)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def option_sets():
    sets = [dict()]
    if "ignore_case" in FLAGS:
        sets.append(dict(ignore_case=True))
    if "min_length" in FLAGS:
        sets += [dict(min_length=3), dict(min_length=5)]
    if "exclude" in FLAGS:
        sets += [dict(exclude=["the"]), dict(exclude=["a", "it's", "xx"])]
    if "min_count" in FLAGS:
        sets += [dict(min_count=2), dict(min_count=3)]
    if "json" in FLAGS:
        sets.append(dict(as_json=True))
    base = list(sets)
    for a in base:
        for b in base:
            merged = dict(a)
            merged.update(b)
            if merged not in sets:
                sets.append(merged)
    return sets


def argv_for(opts):
    argv = []
    for key, value in opts.items():
        flag = FLAGS["json" if key == "as_json" else key]
        if value is True:
            argv.append(flag)
        elif isinstance(value, list):
            for v in value:
                argv += [flag, v]
        else:
            argv += [flag, str(value)]
    return argv


def test_default_output_unchanged(tmp_path):
    for text in TEXTS:
        assert run(tmp_path, text) == reference(text)
        assert run(tmp_path, text, "--top", "3") == reference(text, top=3)


def test_new_options(tmp_path):
    for opts in option_sets():
        for text in TEXTS:
            got = run(tmp_path, text, *argv_for(opts))
            assert got == reference(text, **opts), (opts, text)


def test_help_lists_new_flags(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "wordtool", "--help"], cwd="/app",
                          env=dict(os.environ, PYTHONPATH="/app"), capture_output=True, text=True, timeout=20)
    for flag in FLAGS.values():
        assert flag in proc.stdout
'''


def _gen_add_cli_flag(rng: random.Random, seed: int) -> _Spec:
    keys = rng.sample(sorted(_CLI_FLAGS), rng.choice([1, 1, 2]))
    flags = {k: rng.choice(_CLI_FLAGS[k]["names"]) for k in sorted(keys)}
    top = rng.choice([5, 8, 10, 15, 20])
    app = {
        "wordtool/__init__.py": '"""wordtool: word frequency reports."""\n',
        "wordtool/__main__.py": "import sys\n\nfrom .cli import main\n\nsys.exit(main())\n",
        "wordtool/counting.py": _CLI_COUNTING,
        "wordtool/cli.py": _cli_source(top, {}),
        "README.md": f"# wordtool\n\n    python -m wordtool FILE [--top N]   # N defaults to {top}\n",
    }
    bullets = "\n".join("- " + _CLI_FLAGS[k]["say"].format(flag=f) for k, f in flags.items())
    lead = rng.choice(["Add to the wordtool CLI:", "wordtool needs new option(s):", "Please extend `python -m wordtool`:"])
    instr = f"{lead}\n\n{bullets}\n\nDefault behaviour must not change."
    if len(flags) > 1:
        instr += " Options combine (filters apply before counting; thresholds and --top after)."
    return _Spec(
        instruction=instr,
        app=app,
        tests={"test_outputs.py": _CLI_TESTS.format(top=top, flags=flags)},
        solution={"wordtool/cli.py": _cli_source(top, flags)},
        difficulty="easy" if len(flags) == 1 else "medium",
        category="feature",
        tags=["python", "cli", "argparse", "feature"] + sorted(flags),
    )


# ----------------------------------------------------------------------------------------------
# Family 5: config-repair -- CI fails on the service's config check; fix the config, not the checker.

_CFG_CHECKER = _dedent('''
    """Validation of the service's INI configuration; `python3 -m svc.check FILE` exits 1 on errors."""
    import configparser
    import re
    import sys

    LEVELS = {"DEBUG", "INFO", "WARNING", "ERROR"}
    REQUIRED = {
        "service": ["name", "port", "workers", "log_level"],
        "database": ["url", "pool_size", "timeout"],
        "cache": ["ttl", "max_ttl"],
    }


    def _int(section, key, errors, lo=None, hi=None):
        raw = section.get(key)
        try:
            value = int(raw)
        except (TypeError, ValueError):
            errors.append(f"{section.name}.{key}: expected an integer, got {raw!r}")
            return None
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            errors.append(f"{section.name}.{key}: {value} out of range [{lo}, {hi}]")
        return value


    def validate(cfg):
        errors = []
        for sec, keys in REQUIRED.items():
            if not cfg.has_section(sec):
                errors.append(f"missing section [{sec}]")
                continue
            for key in keys:
                if key not in cfg[sec]:
                    errors.append(f"{sec}.{key}: missing")
        if errors:
            return errors
        svc, db, cache = cfg["service"], cfg["database"], cfg["cache"]
        if not re.fullmatch(r"[a-z][a-z0-9-]{2,30}", svc["name"]):
            errors.append(f"service.name: invalid {svc['name']!r}")
        _int(svc, "port", errors, 1024, 65535)
        workers = _int(svc, "workers", errors, 1, 32)
        if svc["log_level"] not in LEVELS:
            errors.append(f"service.log_level: {svc['log_level']!r} not one of {sorted(LEVELS)}")
        if not re.fullmatch(r"(postgres|sqlite)://\\S+", db["url"]):
            errors.append(f"database.url: unsupported {db['url']!r}")
        pool = _int(db, "pool_size", errors, 1, 100)
        if workers is not None and pool is not None and pool < workers:
            errors.append("database.pool_size: must be at least service.workers")
        try:
            if float(db["timeout"]) <= 0:
                errors.append("database.timeout: must be positive seconds")
        except ValueError:
            errors.append(f"database.timeout: not a number {db['timeout']!r}")
        ttl = _int(cache, "ttl", errors, 0)
        max_ttl = _int(cache, "max_ttl", errors, 1)
        if ttl is not None and max_ttl is not None and ttl > max_ttl:
            errors.append("cache.ttl: larger than cache.max_ttl")
        return errors


    def main(argv=None):
        argv = sys.argv[1:] if argv is None else argv
        cfg = configparser.ConfigParser(interpolation=None)
        with open(argv[0], encoding="utf-8") as fh:
            cfg.read_file(fh)
        errors = validate(cfg)
        for err in errors:
            print("config error:", err, file=sys.stderr)
        if not errors:
            print("config ok")
        return 1 if errors else 0


    if __name__ == "__main__":
        sys.exit(main())
    ''')

# fault -> (section, key, bad value, fixed value, symptom hint)
_CFG_FAULTS = {
    "port_low": ("service", "port", "80", None, "port"),
    "port_high": ("service", "port", "80800", None, "port"),
    "level": ("service", "log_level", "VERBOSE", "DEBUG", "log level"),
    "level_case": ("service", "log_level", "info", "INFO", "log level"),
    "workers": ("service", "workers", "0", None, "workers"),
    "url": ("database", "url", "postgres//db.internal:5432/app", "postgres://db.internal:5432/app", "db url"),
    "timeout_unit": ("database", "timeout", "2.5s", "2.5", "timeout"),
    "name": ("service", "name", "Billing_API", "billing-api", "service name"),
    "ttl": ("cache", "ttl", "7200", None, "ttl"),
    "pool": ("database", "pool_size", "2", None, "pool"),
    "missing": ("database", "timeout", None, None, "timeout"),
}


def _cfg_values(rng: random.Random) -> dict[str, dict[str, str]]:
    workers = rng.randint(2, 16)
    return {
        "service": {"name": rng.choice(["billing-api", "search", "ledger", "notify-worker"]),
                    "port": str(rng.choice([8080, 8443, 9000, 5000 + rng.randint(0, 999)])),
                    "workers": str(workers),
                    "log_level": rng.choice(["INFO", "WARNING", "DEBUG"])},
        "database": {"url": rng.choice(["postgres://db.internal:5432/app", "sqlite:///var/lib/app.db"]),
                     "pool_size": str(workers + rng.randint(0, 10)),
                     "timeout": rng.choice(["2.5", "5", "0.75", "10"])},
        "cache": {"ttl": str(rng.choice([60, 300, 600])), "max_ttl": str(rng.choice([900, 3600]))},
    }


def _ini(values: dict[str, dict[str, str | None]]) -> str:
    out = []
    for sec, kv in values.items():
        out.append(f"[{sec}]")
        out += [f"{k} = {v}" for k, v in kv.items() if v is not None]
        out.append("")
    return "\n".join(out)


_CFG_TESTS = '''\
import configparser
import hashlib
import pathlib
import subprocess
import sys

ORIGINAL = {original!r}
BROKEN = {broken!r}
PROTECTED = {protected!r}


def load(path):
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read(path)
    return {{s: dict(cfg[s]) for s in cfg.sections()}}


def test_ci_passes():
    proc = subprocess.run(["bash", "ci.sh"], cwd="/app", capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "config ok" in proc.stdout
    assert "passed" in proc.stdout


def test_checker_and_tests_untouched():
    for rel, digest in PROTECTED.items():
        assert hashlib.sha256(pathlib.Path("/app", rel).read_bytes()).hexdigest() == digest, rel


def test_config_valid_by_pristine_checker():
    sys.path.insert(0, "/tests")
    import pristine_check
    cfg = configparser.ConfigParser(interpolation=None)
    cfg.read("/app/config/service.ini")
    assert pristine_check.validate(cfg) == []


def test_only_broken_keys_changed():
    now = load("/app/config/service.ini")
    for sec, kv in ORIGINAL.items():
        for key, value in kv.items():
            if (sec, key) in BROKEN:
                continue
            assert now[sec][key] == value, f"{{sec}}.{{key}} should not change"
    for sec, key in BROKEN:
        assert sec in now and key in now[sec], f"{{sec}}.{{key}} must be set"
'''

_CFG_APP_TEST = _dedent('''
    import configparser

    from svc.check import validate


    def load():
        cfg = configparser.ConfigParser(interpolation=None)
        cfg.read("config/service.ini")
        return cfg


    def test_config_is_valid():
        assert validate(load()) == []


    def test_rejects_bad_level():
        cfg = load()
        cfg["service"]["log_level"] = "LOUD"
        assert any("log_level" in e for e in validate(cfg))
    ''')

_CI_SH = """\
#!/usr/bin/env bash
# CI: validate the deployed config, then run the unit tests.
set -euo pipefail
cd "$(dirname "$0")"
python3 -m svc.check config/service.ini
python3 -m pytest -q -p no:cacheprovider tests
"""


def _gen_config_repair(rng: random.Random, seed: int) -> _Spec:
    import hashlib

    values = _cfg_values(rng)
    faults = rng.sample(sorted(_CFG_FAULTS), rng.choice([1, 2, 2, 3]))
    # one fault per key
    seen, chosen = set(), []
    for f in faults:
        sec, key = _CFG_FAULTS[f][:2]
        if (sec, key) not in seen and not (f == "pool" and ("service", "workers") in seen) \
                and not (f == "workers" and ("database", "pool_size") in seen):
            seen.add((sec, key))
            chosen.append(f)
    broken = {s: dict(kv) for s, kv in values.items()}
    fixed = {s: dict(kv) for s, kv in values.items()}
    for f in chosen:
        sec, key, bad, good, _ = _CFG_FAULTS[f]
        if f == "pool":
            broken[sec][key] = str(max(1, int(values["service"]["workers"]) - rng.randint(1, 2)))
        elif f == "ttl":
            broken[sec][key] = str(int(values["cache"]["max_ttl"]) * 2)
        else:
            broken[sec][key] = bad
        fixed[sec][key] = good if good is not None else values[sec][key]
    app = {
        "svc/__init__.py": '"""svc: the service package."""\n',
        "svc/check.py": _CFG_CHECKER,
        "tests/test_config.py": _CFG_APP_TEST,
        "config/service.ini": _ini(broken),
        "ci.sh": _CI_SH,
    }
    protected = {rel: hashlib.sha256(app[rel].encode()).hexdigest()
                 for rel in ("svc/check.py", "tests/test_config.py", "ci.sh")}
    original = {s: {k: v for k, v in kv.items() if v is not None} for s, kv in broken.items()}
    broken_keys = sorted({(_CFG_FAULTS[f][0], _CFG_FAULTS[f][1]) for f in chosen})
    name = values["service"]["name"]
    instr = rng.choice([
        f"CI is red for {name}: `bash ci.sh` fails at the config check. Fix config/service.ini (the checker and "
        "tests are right; leave them alone). Don't change unrelated settings.",
        f"The {name} deploy pipeline fails on `ci.sh`. The config checker is correct, the config is not. Fix "
        "config/service.ini with minimal changes.",
        f"{name}: `ci.sh` rejects our config after the last edit. Repair config/service.ini so CI passes; only "
        "touch the broken settings.",
    ])
    return _Spec(
        instruction=instr,
        app=app,
        tests={"test_outputs.py": _CFG_TESTS.format(original=original, broken=broken_keys, protected=protected),
               "pristine_check.py": _CFG_CHECKER},
        solution={"config/service.ini": _ini(fixed)},
        difficulty="easy" if len(chosen) == 1 else "medium",
        category="devops",
        tags=["ci", "config", "devops"] + chosen,
    )


# ----------------------------------------------------------------------------------------------
# Registry and entry point.

FAMILIES: dict[str, Family] = {
    "off-by-one": Family("off-by-one", "A boundary bug planted in one of six sequence helpers; fix it.", "debugging"),
    "implement-spec": Family("implement-spec", "Implement a text normaliser whose ordered steps vary by seed.",
                             "feature"),
    "rename-api": Family("rename-api", "Rename a pricing function across a package, with or without a "
                         "deprecated alias.", "refactor"),
    "add-cli-flag": Family("add-cli-flag", "Add one or two options to an argparse word-count CLI.", "feature"),
    "config-repair": Family("config-repair", "CI fails on a config check; repair the INI config minimally.",
                            "devops"),
}

_GENERATORS = {
    "off-by-one": _gen_off_by_one,
    "implement-spec": _gen_implement_spec,
    "rename-api": _gen_rename_api,
    "add-cli-flag": _gen_add_cli_flag,
    "config-repair": _gen_config_repair,
}


def task_id_for(family: str, seed: int) -> str:
    """The directory name generate_task uses: ``<family>-<seed>``."""
    return f"{family}-{seed}"


def generate_task(family: str, seed: int, dest: pathlib.Path | str) -> pathlib.Path:
    """Write the task (family, seed) as ``dest/<family>-<seed>/`` and return that path.

    ``dest`` is the parent directory (created if needed); an existing task directory of the same
    id is replaced. Deterministic: equal arguments give byte-identical files.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown task family {family!r}; accepted: {', '.join(sorted(FAMILIES))}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    spec = _GENERATORS[family](_rng(family, seed), seed)
    root = pathlib.Path(dest) / task_id_for(family, seed)
    _materialise(spec, root)
    return root
