"""The import graph keeps docs/architecture.md's layering: no module imports a higher layer, the
environment server imports nothing of the rest but its public surface is `composer_jax.env.api`, no
module imports another module's `_private` name, and no import circle exists anywhere (inside a
package too, function-local and TYPE_CHECKING imports counted).

The graph is read from the source (every `import` statement, function-local ones included), so a
lazy import that reaches upwards is caught like a top-level one.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"

# Lowest first; a module may import its own layer and those before it (docs/architecture.md).
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("errors", ("composer_jax.errors", "composer_jax.flags")),
    ("config", ("composer_jax.config",)),
    ("sharding", ("composer_jax.sharding", "composer_jax.multihost")),
    ("quant", ("composer_jax.quant",)),
    ("model", ("composer_jax.model",)),
    ("formats", ("composer_jax.formats",)),
    ("data", ("composer_jax.data",)),
    ("checkpoint", ("composer_jax.checkpoint",)),
    ("hf", ("composer_jax.hf",)),
    ("weightsync", ("composer_jax.weightsync",)),
    ("train", ("composer_jax.train",)),
    ("inference", ("composer_jax.inference",)),
    ("runtime", ("composer_jax.runtime",)),
    ("rl", ("composer_jax.rl",)),
    ("app", ("composer_jax.cli", "composer_jax.demo", "composer_jax.inspection", "composer_jax")),
]
# The environment server is a separate service (no JAX): it imports nothing of the others but the
# ground floor's standard-library-only modules (the shared error types, the command-line value
# types), and only `formats`, `data`, `rl` and the app may import it - its public package, `env.api`
# (every module in that package is public; nothing outside it is).
ENV = "composer_jax.env"
ENV_API = "composer_jax.env.api"
ENV_PUBLIC = tuple(
    f"{ENV_API}.{p.stem}" for p in sorted((SRC / Path(*ENV_API.split("."))).glob("*.py")) if p.stem != "__init__"
)
ENV_USERS = ("formats", "data", "rl", "app")


def _module_name(path: Path) -> str:
    rel = path.relative_to(SRC).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def layer_of(module: str) -> int | str:
    if _within(module, ENV):
        return "env"
    best = None
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if _within(module, p) and (best is None or len(p) > best[1]):
                best = (i, len(p))
    assert best is not None, f"{module} is in no layer of tests/test_layers.py"
    return best[0]


def _imports(path: Path, module: str) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every import of a composer_jax module."""
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[str, str | None, int]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            for a in node.names:
                out.append((base, a.name, node.lineno))
    return [(m, n, line) for m, n, line in out if _within(m, "composer_jax")]


def _graph() -> list[tuple[str, str, str | None, str]]:
    edges = []
    for path in sorted((SRC / "composer_jax").rglob("*.py")):
        mod = _module_name(path)
        for target, name, line in _imports(path, mod):
            # `from composer_jax.model import params` imports a module, not a name
            if name is not None and (SRC / Path(*target.split("."), name)).with_suffix(".py").exists():
                target, name = f"{target}.{name}", None
            edges.append((mod, target, name, f"{path.relative_to(ROOT)}:{line}"))
    return edges


EDGES = _graph()


def test_env_surface_is_its_api_package():
    assert set(ENV_PUBLIC) == {f"{ENV_API}.protocol", f"{ENV_API}.client", f"{ENV_API}.errors"}


def circles(edges) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    graph: dict[str, set[str]] = {}
    for src, dst, _, _ in edges:
        if dst != src and not _within(src, dst):  # a module importing its own package's __init__ is no circle
            graph.setdefault(src, set()).add(dst)
            graph.setdefault(dst, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_no_import_circles():
    found = circles(EDGES)
    assert not found, "import circles (a definition in the wrong module):\n" + "\n".join(" <-> ".join(c) for c in found)


def test_circle_rule_catches_a_circle_inside_a_package(monkeypatch):
    edges = [
        ("composer_jax.env.tasks.store", "composer_jax.env.sandbox.pyenv", None, "a.py:1"),
        ("composer_jax.env.sandbox.pyenv", "composer_jax.env.tasks.store", None, "b.py:9"),  # function-local
        ("composer_jax.model.moe", "composer_jax.config", None, "c.py:1"),
    ]
    monkeypatch.setattr(sys.modules[__name__], "EDGES", edges)
    with pytest.raises(AssertionError, match="composer_jax.env.sandbox.pyenv <-> composer_jax.env.tasks.store"):
        test_no_import_circles()


def test_graph_is_read():
    # a few edges that exist today: the reader sees top-level, lazy and package-relative imports
    pairs = {(a, b) for a, b, _, _ in EDGES}
    assert ("composer_jax.model.params", "composer_jax.config") in pairs
    assert ("composer_jax.train.pretrain", "composer_jax.model.transformer") in pairs
    assert len(EDGES) > 100


def test_no_upward_imports():
    bad = []
    for src, dst, _, where in EDGES:
        a, b = layer_of(src), layer_of(dst)
        if a == "env" and b != "env":
            if not any(_within(dst, p) for p in LAYERS[0][1]):
                bad.append(f"{where}: {src} (env) imports {dst}: the environment server imports nothing else")
        elif b == "env":
            if a == "env":
                continue
            if LAYERS[a][0] not in ENV_USERS or not any(_within(dst, p) for p in ENV_PUBLIC):
                bad.append(f"{where}: {src} imports {dst}: only {ENV_USERS} may import the env protocol/client")
        elif b > a:
            bad.append(f"{where}: {src} (layer {LAYERS[a][0]}) imports {dst} (higher layer {LAYERS[b][0]})")
    assert not bad, "\n".join(bad)


def test_no_private_names_across_modules():
    bad = [
        f"{where}: {src} imports {dst}.{name}"
        for src, dst, name, where in EDGES
        if name and name.startswith("_") and not name.startswith("__") and dst != src
    ]
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize(
    "src, dst, expect",
    [
        ("composer_jax.model.moe", "composer_jax.train.step", "higher layer"),
        ("composer_jax.env.server.app", "composer_jax.config", "imports nothing else"),
        ("composer_jax.train.loop", "composer_jax.env.server.app", "env protocol/client"),
    ],
)
def test_rule_catches_violations(src, dst, expect, monkeypatch):
    monkeypatch.setattr(sys.modules[__name__], "EDGES", [(src, dst, None, "x.py:1")])
    with pytest.raises(AssertionError, match=expect):
        test_no_upward_imports()
