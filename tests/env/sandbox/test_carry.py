"""The grade's carry (sandbox/snapshot.py, run as the grader runs it: `python3 -I -c SOURCE`): the
agent's change reaches the pristine copy only as a text patch. Each class of what is not carried is
named, the declared test infrastructure is carried, the lever scan reads only what the change adds,
and the diff it prints is the patch: `git apply` (the oracle) turns the pristine tree into the
graded one."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

from composer_jax.env.sandbox import snapshot
from composer_jax.env.tasks import tampering

SOURCE = Path(snapshot.__file__).read_text()

PRISTINE = {
    "pkg/__init__.py": "",
    "pkg/calc.py": "def add(a, b):\n    return a - b\n",
    "pkg/old.py": "X = 1\n",
    "tests/test_calc.py": "from pkg.calc import add\n\ndef test_add():\n    assert add(1, 2) == 3\n",
    "tests/conftest.py": "X = 1\n",
    "setup.cfg": "[metadata]\nname = calc\n\n[tool:pytest]\naddopts = -q\n",
    "pyproject.toml": '[project]\nname = "calc"\n',
    "scripts/boot.py": "import sys\nsys.path.insert(0, '.')\n",
}


def tree(root: Path, files: Mapping[str, str | bytes]) -> Path:
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data.encode() if isinstance(data, str) else data)
    return root


def carry(tmp_path: Path, change, policy: dict | None = None) -> tuple[dict, str, Path]:
    """(facts, diff, graded tree) of carrying `change` (a function editing a copy of PRISTINE)."""
    orig = tree(tmp_path / "orig", PRISTINE)
    work = tmp_path / "work"
    shutil.copytree(orig, work, symlinks=True)
    change(work)
    dest = tmp_path / "dest"
    dest.mkdir()
    argv = [sys.executable, "-I", "-c", SOURCE, str(work), str(dest), str(orig), "262144"]
    argv += [json.dumps(policy or {}), tampering.LEVERS_SOURCE]
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    return json.loads(out.stderr.strip().splitlines()[-1]), out.stdout, dest


def classes(facts: dict) -> dict[str, str]:
    return {e["path"]: e["class"] for e in facts["excluded"]}


def test_text_changes_are_carried_and_the_diff_is_the_patch(tmp_path):
    def change(w: Path) -> None:
        (w / "pkg/calc.py").write_text("def add(a, b):\n    return a + b\n")
        (w / "pkg/old.py").unlink()
        tree(w, {"pkg/new.py": "Y = 2\n", "calendar.py": "def week():\n    return 7\n", "docs/a.md": "x\n"})
        (w / "run.sh").write_text("#!/bin/sh\necho hi\n")
        (w / "run.sh").chmod(0o755)

    facts, diff, dest = carry(tmp_path, change)
    assert facts["excluded"] == [] and facts["levers"] == [] and facts["carried"] == 6
    assert (dest / "pkg/calc.py").read_text().endswith("a + b\n") and not (dest / "pkg/old.py").exists()
    assert (dest / "calendar.py").exists() and os.access(dest / "run.sh", os.X_OK)
    if shutil.which("git"):  # the diff applied to the pristine tree gives the graded one
        applied = tmp_path / "applied"
        shutil.copytree(tmp_path / "orig", applied)
        subprocess.run(["git", "apply", "-"], cwd=applied, input=diff.encode(), check=True)
        for rel in ("pkg/calc.py", "pkg/new.py", "calendar.py", "run.sh"):
            assert (applied / rel).read_bytes() == (dest / rel).read_bytes(), rel
        assert not (applied / "pkg/old.py").exists()


def test_what_a_text_patch_cannot_say_is_named_and_not_carried(tmp_path):
    def change(w: Path) -> None:
        (w / "pkg/calc.py").write_text("def add(a, b):\n    return a + b\n")  # carried
        (w / "xml").mkdir()
        (w / "xml/__init__.pyc").write_bytes(b"\x00\x01planted")
        (w / "native.so").write_bytes(b"ELF")
        (w / "blob.bin").write_bytes(bytes(range(256)))
        (w / "link").symlink_to("pkg")
        tree(w, {".git/hide/evil.py": "import os\n", "pkg/__pycache__/calc.cpython-311.pyc": b"\x00"})
        tree(w, {"sitecustomize.py": "import os\n", "zz.pth": "import sitecustomize\n"})
        tree(w, {"conftest.py": "X = 2\n", "tests/conftest.py": "X = 3\n"})
        tree(w, {"tests/test_calc.py": "def test_add():\n    pass\n"})  # a graded test file
        tree(w, {"pytest.ini": "[pytest]\naddopts = -p evil\n"})
        tree(w, {"tox.ini": "[tox]\nenvlist = py\n\x0c[pytest]\naddopts = -p evil\n"})
        tree(w, {"setup.cfg": "[metadata]\rname = calc\r[tool:pytest]\raddopts = -p evil\n"})
        (w / "scripts/boot.py").write_text("import sys\nsys.path.insert(0, '.')\nsys.path.insert(0, '/tmp')\n")

    facts, _, dest = carry(tmp_path, change, {"test_files": ["tests/test_calc.py"]})
    assert classes(facts) == {
        "xml/__init__.pyc": "bytecode",
        "native.so": "bytecode",
        "blob.bin": "binary",
        "link": "symlink",
        ".git": "vcs",
        "pkg/__pycache__": "cache",
        "sitecustomize.py": "startup-hook",
        "zz.pth": "startup-hook",
        "conftest.py": "conftest",
        "tests/conftest.py": "conftest",
        "tests/test_calc.py": "test-file",
        "pytest.ini": "test-config",
        "tox.ini": "test-config",
        "setup.cfg": "test-config",
    }
    for rel in ("tests/conftest.py", "tests/test_calc.py", "setup.cfg"):
        assert (dest / rel).read_text() == PRISTINE[rel], rel
    for rel in ("xml", "native.so", "link", ".git", "sitecustomize.py", "pytest.ini", "conftest.py"):
        assert not os.path.lexists(dest / rel), rel
    assert (dest / "pkg/calc.py").read_text().endswith("a + b\n")
    # the lever scan: only the line the change added to a file that already had one like it
    assert [(x["path"], x["line"], x["lever"]) for x in facts["levers"]] == [("scripts/boot.py", 3, "import-system")]


def test_declared_and_harmless_configuration_is_carried(tmp_path):
    def change(w: Path) -> None:
        (w / "setup.cfg").write_text("[metadata]\nname = calc2\n\n[tool:pytest]\naddopts = -q\n")  # no pytest change
        (w / "pyproject.toml").write_text('[project]\nname = "calc"\n\n[tool.pytest.ini_options]\naddopts = "-x"\n')
        (w / "tests/conftest.py").write_text("X = 9\n")

    facts, _, dest = carry(tmp_path, change, {"code_under_test": ["pyproject.toml", "tests/*.py"]})
    assert facts["excluded"] == []
    assert "calc2" in (dest / "setup.cfg").read_text() and "-x" in (dest / "pyproject.toml").read_text()
    assert (dest / "tests/conftest.py").read_text() == "X = 9\n"


def test_the_shadow_rule_is_for_verifiers_this_project_did_not_write(tmp_path):
    def change(w: Path) -> None:
        tree(
            w,
            {"pytest.py": "def console_main():\n    return 0\n", "json.py": "X = 1\n", "src/unittest/__init__.py": ""},
        )
        tree(w, {"mytool.py": "X = 1\n"})

    facts, _, _ = carry(tmp_path / "a", change, {"shadow_rule": True})
    assert classes(facts) == {
        "pytest.py": "runner-shadow",
        "json.py": "runner-shadow",
        "src/unittest/__init__.py": "runner-shadow",
    }
    facts, _, dest = carry(tmp_path / "b", change, {"shadow_rule": False})
    assert facts["excluded"] == [] and (dest / "json.py").exists()


@pytest.mark.parametrize(
    ("pristine_tail", "added", "found"),
    [
        ("", "import os as _o\n_o._exit(0)\n", [("exit", 4)]),
        ("import sys\nsys._getframe(1)\n", "", []),  # the pristine file's own lever is not the agent's
    ],
)
def test_levers_are_read_against_the_pristine_file(tmp_path, pristine_tail, added, found):
    PRISTINE_CALC = PRISTINE["pkg/calc.py"]
    try:
        PRISTINE["pkg/calc.py"] = PRISTINE_CALC + pristine_tail

        def change(w: Path) -> None:
            (w / "pkg/calc.py").write_text(PRISTINE["pkg/calc.py"].replace("a - b", "a + b") + added)

        facts, _, _ = carry(tmp_path, change)
    finally:
        PRISTINE["pkg/calc.py"] = PRISTINE_CALC
    assert [(x["lever"], x["line"]) for x in facts["levers"]] == found


def test_pytest_part_reads_ini_as_pytest_does():
    cr = b"[metadata]\rname = x\r[tool:pytest]\raddopts = -p evil\n"
    assert snapshot.pytest_part("setup.cfg", cr) != snapshot.pytest_part("setup.cfg", b"[metadata]\nname = x\n")
    assert snapshot.pytest_part("setup.cfg", b"[metadata]\nname = y\n") == ""
    assert snapshot.pytest_part("pytest.ini", b"") == " "  # a pytest.ini, even empty, is configuration


def test_a_long_excluded_list_ends_with_a_count(tmp_path):
    def change(w: Path) -> None:
        for i in range(snapshot.MAX_EXCLUDED + 5):
            (w / f"d{i}" / "__pycache__").mkdir(parents=True)

    facts, _, _ = carry(tmp_path, change)
    assert len(facts["excluded"]) == snapshot.MAX_EXCLUDED + 1
    assert facts["excluded"][-1] == {"path": "... and 5 more", "class": "truncated"}


def _graded_files(dest: Path) -> dict[str, tuple[bytes, bool]]:
    files = (p for p in sorted(dest.rglob("*")) if p.is_file())
    return {str(p.relative_to(dest)): (p.read_bytes(), os.access(p, os.X_OK)) for p in files}


def test_carried_sha256_names_the_graded_tree(tmp_path):
    """carried_sha256 (the grade cache's key, tasks/grader.py GradeCache): equal for two carries that
    make equal graded trees however the workspaces differ in what is not carried; different when a
    carried file's bytes, mode, path or a deletion differ."""

    def fix(w: Path) -> None:
        (w / "pkg/calc.py").write_text("def add(a, b):\n    return a + b\n")

    def fix_with_junk(w: Path) -> None:  # the same fix, plus what the carry does not take
        fix(w)
        tree(w, {"pkg/__pycache__/calc.cpython-311.pyc": b"\x00junk", ".git/HEAD": "ref\n"})

    variants = {
        "fix": fix,
        "fix, one more byte": lambda w: (w / "pkg/calc.py").write_text("def add(a, b):\n    return a + b \n"),
        "fix, executable": lambda w: (fix(w), (w / "pkg/calc.py").chmod(0o755)),
        "fix elsewhere": lambda w: tree(w, {"pkg/calc2.py": "def add(a, b):\n    return a + b\n"}),
        "fix and a deletion": lambda w: (fix(w), (w / "pkg/old.py").unlink()),
        "nothing": lambda w: None,
    }
    hashes, trees = {}, {}
    for i, (name, change) in enumerate(variants.items()):
        facts, _, dest = carry(tmp_path / str(i), change)
        hashes[name], trees[name] = facts["carried_sha256"], _graded_files(dest)
    assert len(set(hashes.values())) == len(variants)  # every graded tree its own hash
    facts, _, dest = carry(tmp_path / "junk", fix_with_junk)
    assert facts["carried_sha256"] == hashes["fix"] and _graded_files(dest) == trees["fix"]
    assert {e["class"] for e in facts["excluded"]} == {"cache", "vcs"}
