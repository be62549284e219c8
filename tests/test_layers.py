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
    # where a run's processes run (placements, the trainer's hosts): it needs only config, and the
    # trainer's own command places its hosts with it
    ("runtime", ("composer_jax.runtime",)),
    ("sharding", ("composer_jax.sharding", "composer_jax.multihost", "composer_jax.specs")),
    ("quant", ("composer_jax.quant",)),
    ("model", ("composer_jax.model",)),
    ("formats", ("composer_jax.formats",)),
    ("data", ("composer_jax.data",)),
    ("checkpoint", ("composer_jax.checkpoint",)),
    ("hf", ("composer_jax.hf",)),
    ("weightsync", ("composer_jax.weightsync",)),
    ("train", ("composer_jax.train",)),
    # the engine (sampler, drivers) imports nothing of the server (HTTP, metrics, checkpoint loading, CLI)
    ("inference.engine", ("composer_jax.inference", "composer_jax.inference.engine")),
    ("inference.server", ("composer_jax.inference.server",)),
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


EDGES = _ALL_EDGES = _graph()


def test_env_surface_is_its_api_package():
    assert set(ENV_PUBLIC) == {f"{ENV_API}.protocol", f"{ENV_API}.client", f"{ENV_API}.errors"}


def circles(edges) -> list[list[str]]:
    """Strongly connected components of more than one module."""
    graph: dict[str, set[str]] = {}
    for src, dst, _, _ in edges:
        if dst != src and not _within(src, dst):  # a module importing its own package's __init__ is no circle
            graph.setdefault(src, set()).add(dst)
            graph.setdefault(dst, set())
    return _components(graph)


def _components(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
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


def package_of(module: str) -> str:
    """The package a module belongs to: a package is its own, a module its parent's, cut at
    `composer_jax.X.Y` (a package nested deeper, `env.tasks.families`, belongs to `env.tasks`). A
    module directly under `composer_jax` (`errors.py`, `sharding.py`, `cli.py`) is a layer of its own,
    not part of a package of everything."""
    parts = module.split(".")
    if not (SRC / Path(*parts)).is_dir() and len(parts) > 2:
        parts = parts[:-1]
    return ".".join(parts[:3])


def package_circles(edges) -> dict[frozenset[str], str]:
    """Each circle between sub-packages as "a -> b (where) -> ... -> a": a module of `a` imports one
    of `b` and so on back, so neither package can be read, tested or moved without the other. A
    package and its parent count as two (`rl.rollout` importing `rl/evaluate.py` while `rl/learner.py`
    imports `rl.rollout` is a circle), which the module graph cannot see."""
    graph: dict[str, set[str]] = {}
    where: dict[tuple[str, str], str] = {}
    for src, dst, _, at in edges:
        a, b = package_of(src), package_of(dst)
        if a != b:
            graph.setdefault(a, set()).add(b)
            graph.setdefault(b, set())
            where.setdefault((a, b), at)
    out = {}
    for comp in _components(graph):
        # the shortest way from the component's first package back to itself, with one import per step
        start, members = comp[0], set(comp)
        prev: dict[str, str] = {}
        frontier = [start]
        while start not in prev:
            nxt = []
            for v in frontier:
                for w in sorted(graph[v] & members):
                    if w not in prev:
                        prev[w] = v
                        nxt.append(w)
            frontier = nxt
        path = [start]
        while len(path) == 1 or path[-1] != start:
            path.append(prev[path[-1]])
        path.reverse()
        cycle = " -> ".join(f"{a} ({where[(a, b)]})" for a, b in zip(path, path[1:])) + f" -> {start}"
        out[frozenset(comp)] = cycle + (f" [one circle of {', '.join(comp)}]" if len(comp) > len(path) - 1 else "")
    return out


# Circles between packages known and not yet undone, each with the reason it is still there; a circle
# listed here that no longer exists fails the test, so the list only shrinks.
KNOWN_PACKAGE_CIRCLES: set[frozenset[str]] = set()


def test_no_circles_between_packages():
    found = package_circles(EDGES)
    if EDGES is _ALL_EDGES:
        gone = KNOWN_PACKAGE_CIRCLES - set(found)
        assert not gone, f"no longer circles, take them out of KNOWN_PACKAGE_CIRCLES: {sorted(map(sorted, gone))}"
        found = {k: v for k, v in found.items() if k not in KNOWN_PACKAGE_CIRCLES}
    assert not found, "import circles between packages (a definition in the wrong package):\n" + "\n".join(
        found.values()
    )


def test_package_circle_rule_sees_a_package_and_its_parent(monkeypatch):
    edges = [
        ("composer_jax.rl.rollout.side", "composer_jax.rl.evaluate", "TaskRef", "side.py:39"),
        ("composer_jax.rl.learner", "composer_jax.rl.rollout.side", None, "learner.py:40"),
        ("composer_jax.env.tasks.families.base", "composer_jax.env.tasks.store", None, "base.py:1"),  # one package
        ("composer_jax.env.tasks.store", "composer_jax.env.tasks.families", None, "store.py:9"),
    ]
    assert package_of("composer_jax.env.tasks.families.base") == "composer_jax.env.tasks"
    assert package_of("composer_jax.rl.evaluate") == "composer_jax.rl"
    assert package_of("composer_jax.rl.rollout") == "composer_jax.rl.rollout"
    assert package_of("composer_jax.errors") == "composer_jax.errors"
    monkeypatch.setattr(sys.modules[__name__], "EDGES", edges)
    circle = r"composer_jax.rl \(learner.py:40\) -> composer_jax.rl.rollout \(side.py:39\) -> composer_jax.rl\n"
    with pytest.raises(AssertionError, match=circle):
        test_no_circles_between_packages()


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
