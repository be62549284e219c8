"""Lint: library modules (not the CLI) must not call print()."""
import ast
import pathlib
import sys

bad = []
for path in sorted(pathlib.Path("kvstore").glob("*.py")):
    if path.name in ("cli.py", "__main__.py"):
        continue
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "print":
            bad.append(f"{path}:{node.lineno}")
if bad:
    sys.exit("print() in library code: " + ", ".join(bad))
print("lint ok")
