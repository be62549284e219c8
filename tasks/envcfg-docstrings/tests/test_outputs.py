import ast
import pathlib
import re

FILES = ["/app/envcfg/settings.py", "/app/envcfg/loader.py"]
PRISTINE = {"settings.py": "/tests/pristine_settings.py", "loader.py": "/tests/pristine_loader.py"}


def strip_docstrings(tree):
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.Module)) and node.body and \
                isinstance(node.body[0], ast.Expr) and isinstance(getattr(node.body[0], "value", None), ast.Constant) \
                and isinstance(node.body[0].value.value, str):
            node.body = node.body[1:] or [ast.Pass()]
    return ast.dump(tree, include_attributes=False)


def public_functions(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and (not node.name.startswith("_") or node.name == "__init__"):
            if node.name == "__init__":
                continue
            yield node


def test_code_unchanged():
    for f in FILES:
        name = pathlib.Path(f).name
        assert strip_docstrings(ast.parse(open(f).read())) == strip_docstrings(ast.parse(open(PRISTINE[name]).read()))


def test_docstrings_complete():
    for f in FILES:
        tree = ast.parse(open(f).read())
        for fn in public_functions(tree):
            doc = ast.get_docstring(fn)
            assert doc, f"{fn.name}: no docstring"
            assert re.search(r"^\s*Args:\s*$", doc, re.M), f"{fn.name}: no Args"
            assert re.search(r"^\s*Returns:\s*$", doc, re.M), f"{fn.name}: no Returns"
            params = [a.arg for a in fn.args.args + fn.args.kwonlyargs if a.arg != "self"]
            if fn.args.vararg:
                params.append(fn.args.vararg.arg)
            args_part = doc.split("Args:", 1)[1].split("Returns:", 1)[0]
            for p in params:
                assert re.search(rf"^\s*\*{{0,2}}{p}\b", args_part, re.M), f"{fn.name}: parameter {p} missing"
            raised = {n.exc.func.id if isinstance(n.exc, ast.Call) and isinstance(n.exc.func, ast.Name) else None
                      for n in ast.walk(fn) if isinstance(n, ast.Raise) and n.exc is not None} - {None}
            if raised:
                assert "Raises:" in doc, f"{fn.name}: no Raises section"
                raises_part = doc.split("Raises:", 1)[1]
                for exc in raised:
                    assert exc in raises_part, f"{fn.name}: {exc} not listed under Raises"
