"""The grade's diff is a patch: `git apply` (the oracle) turns the initial tree into the final one,
for text edits, created / deleted / empty files, text `str.splitlines` would split wrongly, files
without a final newline and binary contents; a diff over its budget ends with the truncation line."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from composer_jax.env.sandbox import snapshot

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")

BEFORE = {
    "pkg/calc.py": b"def add(a, b):\n    return a - b\n",
    "pkg/gone.py": b"x = 1\n",
    "pkg/empty_gone.py": b"",
    "data/blob.bin": bytes(range(256)) * 3,
    "data/latin.txt": "caf\u00e9\n".encode("latin-1"),
    "odd.txt": "a\x0cb\nc\rd\ne\u2028f\n".encode(),
    "tail.txt": b"no newline",
}
AFTER = {
    "pkg/calc.py": b"def add(a, b):\n    return a + b\n",
    "pkg/__init__.py": b"",
    "pkg/new.py": b"from pkg.calc import add\n",
    "data/blob.bin": bytes(range(255, -1, -1)) * 3,
    "data/new.bin": b"\x00\x01\x02" * 1000,
    "data/latin.txt": "caf\u00e9s\n".encode("latin-1"),
    "odd.txt": "a\x0cB\nc\rD\ne\u2028F\n".encode(),
    "tail.txt": b"still no newline",
}


def _tree(root: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    return root


def _files(root: Path) -> dict[str, bytes]:
    return {
        p.relative_to(root).as_posix(): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and ".git" not in p.relative_to(root).parts
    }


def _diff(before: Path, after: Path, budget: int) -> str:
    out: list[str] = []
    ofd, nfd = os.open(before, os.O_RDONLY), os.open(after, os.O_RDONLY)
    try:
        snapshot.diff(ofd, nfd, budget, out.append)
    finally:
        os.close(ofd)
        os.close(nfd)
    return "".join(out)


def _git(cwd: Path, *args: str, stdin: bytes | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(cwd.parent)}
    return subprocess.run(["git", *args], cwd=cwd, input=stdin, capture_output=True, env=env)


def test_the_diff_applies_with_git_apply(tmp_path):
    before = _tree(tmp_path / "before", BEFORE)
    after = _tree(tmp_path / "after", AFTER)
    patch = _diff(before, after, 1 << 20)
    assert "GIT binary patch" in patch and snapshot.TRUNCATED not in patch
    work = tmp_path / "work"
    shutil.copytree(before, work)
    assert _git(work, "init", "-q").returncode == 0
    check = _git(work, "apply", "--check", "-", stdin=patch.encode())
    assert check.returncode == 0, check.stderr.decode()
    assert _git(work, "apply", "-", stdin=patch.encode()).returncode == 0
    assert _files(work) == AFTER
    # and it is git's own reading of the change: the same files, by git's --stat
    stat = _git(work, "apply", "--numstat", "-", stdin=patch.encode()).stdout.decode()
    assert {line.split("\t")[-1] for line in stat.splitlines()} == set(BEFORE) | set(AFTER)


def test_a_diff_over_budget_ends_with_the_truncation_line(tmp_path):
    before = _tree(tmp_path / "before", BEFORE)
    after = _tree(tmp_path / "after", AFTER)
    cut = _diff(before, after, 300)
    assert cut.endswith(snapshot.TRUNCATED) and len(cut.encode()) <= 300 + len(snapshot.TRUNCATED)


def test_symlinks_are_named_not_patched(tmp_path):
    before = _tree(tmp_path / "before", {"a.txt": b"x\n"})
    after = _tree(tmp_path / "after", {"a.txt": b"x\n"})
    (after / "link").symlink_to("a.txt")
    assert _diff(before, after, 1 << 20) == (
        "diff --git a/link b/link\nnew file mode 100644\nBinary files a/link and b/link differ\n"
    )
