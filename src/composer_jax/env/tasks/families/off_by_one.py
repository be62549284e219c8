"""Family off-by-one: one boundary bug planted in one of several small sequence helpers.

The workspace is a tiny package ``rangekit`` with six helpers (chunking, paging, moving sums, ...)
spread over two modules in a seed-dependent split; one helper gets one of its known off-by-one
variants. The instruction quotes one of that helper's example calls, preferring one whose buggy and
correct results differ (both computed by running the generated code), so the agent has to localise
the bug from a symptom. The hidden tests compare every helper with a reference implementation on
random inputs.
"""

from __future__ import annotations

import random

from .base import Family, TaskSpec, run_source

FAMILY = Family("off-by-one", "A boundary bug planted in one of six sequence helpers; fix it.", "debugging")

_FUNCS: dict[str, dict] = {
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
        "examples": [
            "count_between([1, 5, 10, 15], 5, 10)",
            "count_between(list(range(20)), 3, 7)",
            "count_between([2, 2, 9], 2, 9)",
        ],
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
        "examples": [
            "nearest_rank([10, 20, 30, 40, 50], 50)",
            "nearest_rank(list(range(1, 11)), 95)",
            "nearest_rank([1, 2, 3], 100)",
        ],
    },
}

_TESTS = """\
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
"""


def _module_source(funcs: list[str], bug: tuple[str, int] | None, per_page: int) -> str:
    parts = ['"""Small sequence helpers."""\n', "import math\n\n", f"PER_PAGE = {per_page}\n"]
    for name in funcs:
        f = _FUNCS[name]
        body = f["bugs"][bug[1]] if bug is not None and bug[0] == name else f["ok"]
        parts.append(f'\n\ndef {f["sig"]}:\n    """{f["doc"]}"""\n    {body}\n')
    return "".join(parts)


def generate(rng: random.Random, seed: int) -> TaskSpec:
    names = list(_FUNCS)
    target = rng.choice(names)
    bug_idx = rng.randrange(len(_FUNCS[target]["bugs"]))
    per_page = rng.choice([4, 5, 8, 10, 20, 25])
    order = names[:]
    rng.shuffle(order)
    split = rng.randint(2, 4)
    files = {"rangekit/seqs.py": order[:split], "rangekit/numeric.py": order[split:]}

    def render(bug):
        out = {}
        for rel, fs in files.items():
            out[rel] = _module_source(fs, bug, per_page)
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
    target_file = next(rel for rel, fs in files.items() if target in fs)
    env_ok = run_source(fixed[target_file], "<ok>")
    env_bug = run_source(app[target_file], "<bug>")
    examples = _FUNCS[target]["examples"][:]
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
        instr = (
            f"rangekit.{target} has an edge-case bug: `{example}` gives `{bad!r}`, expected `{good!r}`. "
            "Fix it; keep the other helpers as they are."
        )
    else:
        instr = (
            f"Reports are off by one. Traced it to rangekit: `{example}` -> `{bad!r}` (want `{good!r}`). Please fix."
        )
    return TaskSpec(
        instruction=instr,
        app=app,
        tests={"test_outputs.py": _TESTS.format(per_page=per_page)},
        solution={target_file: fixed[target_file]},
        difficulty="easy",
        category="debugging",
        tags=["python", "bugfix", "off-by-one", target],
    )
