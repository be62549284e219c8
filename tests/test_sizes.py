"""Size limits of the source: no function over MAX_FUNCTION_LINES lines and no class over
MAX_CLASS_LINES lines in the packages listed in `PACKAGES` (issue 29's acceptance, now every
package). Lines are a definition's span in the source, decorators and
docstring included, as `ast` reports them (`lineno` to `end_lineno`)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "composer_jax"
MAX_FUNCTION_LINES = 100
MAX_CLASS_LINES = 500
# every package; "." = the modules directly under composer_jax/
PACKAGES = ["inference", "rl", "config", "env", "quant", "data", "model", "train", "checkpoint", "."]


def oversized(path: Path, max_function: int = MAX_FUNCTION_LINES, max_class: int = MAX_CLASS_LINES) -> list[str]:
    """`path:line kind name (n lines)` for every function over `max_function` lines and class over
    `max_class` lines in one source file (nested definitions included)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            kind, limit = "function", max_function
        elif isinstance(node, ast.ClassDef):
            kind, limit = "class", max_class
        else:
            continue
        start = min([node.lineno, *(d.lineno for d in node.decorator_list)])
        n = (node.end_lineno or node.lineno) - start + 1
        if n > limit:
            where = path.relative_to(SRC.parent) if path.is_relative_to(SRC.parent) else path
            out.append(f"{where}:{node.lineno} {kind} {node.name} ({n} lines > {limit})")
    return out


def _files(package: str) -> list[Path]:
    return sorted(SRC.glob("*.py")) if package == "." else sorted((SRC / package).rglob("*.py"))


@pytest.mark.parametrize("package", PACKAGES)
def test_no_function_or_class_over_the_limits(package):
    files = _files(package)
    assert files, f"no sources under {SRC / package}"
    found = [line for f in files for line in oversized(f)]
    assert not found, "over the size limits:\n" + "\n".join(found)


def test_the_measure_counts_what_it_should(tmp_path):
    src = tmp_path / "composer_jax" / "m.py"
    src.parent.mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(4))
    src.write_text(f"@staticmethod\ndef f():\n{body}\n\n\nclass C:\n    def g(self):\n        pass\n")
    # f spans its decorator, its line and 4 body lines: 6; C 3 lines; g 2
    got = [line.split(" ", 1)[1] for line in oversized(src, max_function=5, max_class=2)]
    assert got == ["function f (6 lines > 5)", "class C (3 lines > 2)"]
    assert oversized(src, max_function=6, max_class=3) == []


if __name__ == "__main__":  # python tests/test_sizes.py [PACKAGE ...]: list what is over the limits
    import sys

    for package in sys.argv[1:] or PACKAGES:
        for line in (line for f in _files(package) for line in oversized(f)):
            print(line)
