"""A small git repository built inside a test, whose history the miner and the importer are measured on.

`build(path)` makes the `calc` package's history; `EXPECTED` says, per commit subject, what
`env mine` must make of it: a task with exactly these FAIL_TO_PASS / PASS_TO_PASS node ids and
category, or a rejection with this reason. `tinyfmt_wheelhouse(dir)` builds the extra package one
commit's tests need into a wheelhouse (offline, with pip's own `wheel` command).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

OPS_V1 = """\
def add(a, b):
    return a + b


def div(a, b):
    return a // b
"""

OPS_V2 = OPS_V1.replace("a // b", "a / b")

TEST_OPS_V1 = """\
from calc.ops import add


def test_add():
    assert add(2, 3) == 5
"""

TEST_OPS_V2 = """\
from calc.ops import add, div


def test_add():
    assert add(2, 3) == 5


def test_div():
    assert div(1, 2) == 0.5, "div must be true division"
"""

MUL = """

def mul(a, b):
    return a * b
"""

TEST_MUL = """\
from calc.ops import mul


def test_mul():
    assert mul(3, 4) == 12


def test_mul_zero():
    assert mul(0, 9) == 0
"""

CLAMP_V1 = """

def clamp(x, lo, hi):
    return max(lo, x)
"""

CLAMP_V2 = """

def clamp(x, lo, hi):
    if lo > hi:
        raise ValueError(f"empty range {lo}..{hi}")
    return min(hi, max(lo, x))
"""

TEST_CLAMP_V1 = """\
import pytest

from calc.ops import clamp


def test_clamp_low():
    assert clamp(-1, 0, 5) == 0
"""

TEST_CLAMP_V2 = """\
import pytest

from calc.ops import clamp


def test_clamp_low():
    assert clamp(-1, 0, 5) == 0


@pytest.mark.parametrize("x,expected", [(7, 5), (5, 5), (3, 3)])
def test_clamp_high(x, expected):
    assert clamp(x, 0, 5) == expected


class TestRange:
    def test_empty_range(self):
        with pytest.raises(ValueError):
            clamp(1, 5, 0)
"""

PICK = '''

def pick(names):
    """One of `names` (any one)."""
    return next(iter(set(names)))
'''

TEST_PICK = """\
from calc.ops import pick


def test_pick_first():
    # depends on str hashing: passes under some PYTHONHASHSEEDs only
    assert pick(["apple", "banana", "cherry", "damson"]) == "banana"
"""

STATS = """\
def mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs)
"""

TEST_STATS_V1 = """\
from calc.stats import mean


def test_mean():
    assert mean([1, 2, 3]) == 2
"""

TEST_STATS_V2 = (
    TEST_STATS_V1
    + """

def test_mean_of_generator():
    assert mean(x for x in (2, 4)) == 3
"""
)

FMT = """\
import tinyfmt


def show(x):
    return tinyfmt.fmt(x)
"""

TEST_FMT = """\
from calc.fmt import show


def test_show():
    assert show(3) == "<3>"
"""

PYPROJECT_V1 = """\
[project]
name = "calc"
version = "0.1.0"
"""

PYPROJECT_V2 = PYPROJECT_V1 + 'dependencies = ["tinyfmt"]\n'

# subject -> ("task", category, FAIL_TO_PASS, PASS_TO_PASS) or ("rejected", reason)
EXPECTED: dict[str, tuple] = {
    "Initial calc package": ("rejected", "root commit"),
    "Fix div: true division": ("task", "bug fix", ["tests/test_ops.py::test_div"], ["tests/test_ops.py::test_add"]),
    "Docs: usage in the README": ("rejected", "docs/config only"),
    "Add mul": ("task", "feature", ["tests/test_mul.py::test_mul", "tests/test_mul.py::test_mul_zero"], []),
    "Simplify add": ("rejected", "no test change"),
    "Document add, test negatives": ("rejected", "no FAIL_TO_PASS"),
    "Start clamp": ("task", "feature", ["tests/test_clamp.py::test_clamp_low"], []),
    "Fix clamp's upper bound and empty ranges": (
        "task",
        "bug fix",
        [
            "tests/test_clamp.py::TestRange::test_empty_range",
            "tests/test_clamp.py::test_clamp_high[7-5]",
        ],
        [
            "tests/test_clamp.py::test_clamp_high[3-3]",
            "tests/test_clamp.py::test_clamp_high[5-5]",
            "tests/test_clamp.py::test_clamp_low",
        ],
    ),
    "Add pick": ("rejected", "flaky"),
    "More tests for add": ("rejected", "no source change"),
    "Merge branch 'stats'": (
        "task",
        "feature",
        ["tests/test_stats.py::test_mean", "tests/test_stats.py::test_mean_of_generator"],
        [],
    ),
    "Show values with tinyfmt": ("task", "feature", ["tests/test_fmt.py::test_show"], []),
}


def git(repo: Path, *args: str, date: str = "2024-03-01T12:00:00Z") -> str:
    env = dict(
        os.environ,
        GIT_AUTHOR_NAME="Test",
        GIT_AUTHOR_EMAIL="test@example.com",
        GIT_COMMITTER_NAME="Test",
        GIT_COMMITTER_EMAIL="test@example.com",
        GIT_AUTHOR_DATE=date,
        GIT_COMMITTER_DATE=date,
    )
    proc = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, env=env, check=True)
    return proc.stdout


def write(repo: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = repo / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def commit(repo: Path, subject: str, files: dict[str, str], day: int) -> str:
    write(repo, files)
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", subject, date=f"2024-03-{day:02d}T12:00:00Z")
    return git(repo, "rev-parse", "HEAD").strip()


def build(repo: Path, *, with_package: bool = True) -> dict[str, str]:
    """The calc history in `repo` (created); {subject: sha} of the first-parent commits."""
    repo.mkdir(parents=True)
    git(repo, "init", "-q", "-b", "main")
    git(repo, "remote", "add", "origin", "https://github.com/example/calc.git")
    shas = {}
    ops = OPS_V1
    shas["Initial calc package"] = commit(
        repo,
        "Initial calc package",
        {
            "pyproject.toml": PYPROJECT_V1,
            "README.md": "# calc\n",
            "calc/__init__.py": "",
            "calc/ops.py": ops,
            "tests/test_ops.py": TEST_OPS_V1,
        },
        1,
    )
    ops = OPS_V2
    shas["Fix div: true division"] = commit(
        repo, "Fix div: true division", {"calc/ops.py": ops, "tests/test_ops.py": TEST_OPS_V2}, 2
    )
    shas["Docs: usage in the README"] = commit(
        repo, "Docs: usage in the README", {"README.md": "# calc\n\n`from calc.ops import add`\n"}, 3
    )
    ops += MUL
    shas["Add mul"] = commit(repo, "Add mul", {"calc/ops.py": ops, "tests/test_mul.py": TEST_MUL}, 4)
    ops = ops.replace("    return a + b\n", "    result = a + b\n    return result\n", 1)
    shas["Simplify add"] = commit(repo, "Simplify add", {"calc/ops.py": ops}, 5)
    ops = ops.replace("def add(a, b):\n", 'def add(a, b):\n    """a + b"""\n', 1)
    test_ops = TEST_OPS_V2 + "\n\ndef test_add_negative():\n    assert add(-2, 1) == -1\n"
    shas["Document add, test negatives"] = commit(
        repo, "Document add, test negatives", {"calc/ops.py": ops, "tests/test_ops.py": test_ops}, 6
    )
    ops += CLAMP_V1
    shas["Start clamp"] = commit(repo, "Start clamp", {"calc/ops.py": ops, "tests/test_clamp.py": TEST_CLAMP_V1}, 6)
    ops = ops.replace(CLAMP_V1, CLAMP_V2)
    shas["Fix clamp's upper bound and empty ranges"] = commit(
        repo,
        "Fix clamp's upper bound and empty ranges",
        {"calc/ops.py": ops, "tests/test_clamp.py": TEST_CLAMP_V2},
        7,
    )
    ops += PICK
    shas["Add pick"] = commit(repo, "Add pick", {"calc/ops.py": ops, "tests/test_pick.py": TEST_PICK}, 8)
    shas["More tests for add"] = commit(
        repo,
        "More tests for add",
        {"tests/test_ops.py": test_ops + "\n\ndef test_add_zero():\n    assert add(0, 0) == 0\n"},
        9,
    )
    # a branch of two commits merged without fast-forward: first-parent history sees one change
    git(repo, "checkout", "-q", "-b", "stats")
    commit(repo, "stats: mean", {"calc/stats.py": "def mean(xs):\n    return sum(xs) / len(xs)\n"}, 10)
    commit(repo, "stats: tests", {"tests/test_stats.py": TEST_STATS_V1}, 10)
    commit(repo, "stats: generators", {"calc/stats.py": STATS, "tests/test_stats.py": TEST_STATS_V2}, 11)
    git(repo, "checkout", "-q", "main")
    git(repo, "merge", "-q", "--no-ff", "-m", "Merge branch 'stats'", "stats", date="2024-03-12T12:00:00Z")
    shas["Merge branch 'stats'"] = git(repo, "rev-parse", "HEAD").strip()
    if with_package:
        shas["Show values with tinyfmt"] = commit(
            repo,
            "Show values with tinyfmt",
            {"pyproject.toml": PYPROJECT_V2, "calc/fmt.py": FMT, "tests/test_fmt.py": TEST_FMT},
            13,
        )
    return shas


def tinyfmt_wheelhouse(dest: Path) -> Path:
    """A wheelhouse holding tinyfmt 1.0 (built here, offline, by `pip wheel --no-build-isolation`)."""
    src = dest.parent / "tinyfmt-src"
    write(
        src,
        {
            "pyproject.toml": textwrap.dedent(
                """\
                [build-system]
                requires = ["setuptools"]
                build-backend = "setuptools.build_meta"

                [project]
                name = "tinyfmt"
                version = "1.0"
                """
            ),
            "tinyfmt.py": 'def fmt(x):\n    return f"<{x}>"\n',
        },
    )
    dest.mkdir(parents=True, exist_ok=True)
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            "-w",
            str(dest),
            str(src),
        ],
        check=True,
        capture_output=True,
    )
    return dest
