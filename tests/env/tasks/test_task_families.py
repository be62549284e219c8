"""The parametrised task families: API, determinism, and oracle 1 / untouched 0 under the sandbox."""

from __future__ import annotations

import ast
import hashlib
import pathlib
import sys
import tomllib

import pytest
from support import harbor_oracle
from support.bwrap import needs_bwrap

from composer_jax.env.tasks.families import FAMILIES, Family, generate_task


def tree_digest(root: pathlib.Path) -> dict[str, str]:
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def test_registry_shape():
    assert len(FAMILIES) >= 5
    for name, fam in FAMILIES.items():
        assert isinstance(fam, Family) and fam.name == name and fam.description and fam.kind


def test_generator_is_stdlib_only():
    """Every module of the package imports only the standard library and its own siblings (the
    environment server runs without JAX, and env/ depends on nothing else of composer_jax)."""
    import composer_jax.env.tasks.families as mod

    modules = sorted(pathlib.Path(mod.__file__).parent.glob("*.py"))
    assert len(modules) >= 7, [m.name for m in modules]  # __init__, base and one per family
    for path in modules:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            else:
                continue
            for name in names:
                assert name.split(".")[0] in sys.stdlib_module_names, f"{path.name} imports {name}"


def test_unknown_family_raises_with_accepted_names(tmp_path):
    with pytest.raises(ValueError) as err:
        generate_task("no-such-family", 0, tmp_path)
    msg = str(err.value)
    assert "no-such-family" in msg
    for name in FAMILIES:
        assert name in msg


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_deterministic_and_well_formed(family, tmp_path):
    a = generate_task(family, 7, tmp_path / "a")
    b = generate_task(family, 7, tmp_path / "b")
    assert a.name == b.name == f"{family}-7"
    assert tree_digest(a) == tree_digest(b)
    # regenerating over an existing directory gives the same bytes too
    assert tree_digest(generate_task(family, 7, tmp_path / "a")) == tree_digest(a)
    meta = tomllib.loads((a / "task.toml").read_text())
    assert meta["version"] == "1.0" and meta["metadata"]["difficulty"] in {"easy", "medium", "hard"}
    for rel in ("instruction.md", "environment/Dockerfile", "tests/test.sh", "solution/solve.sh"):
        assert (a / rel).is_file(), rel
    assert any((a / "environment" / "app").rglob("*.py"))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_seeds_give_substantively_different_tasks(family, tmp_path):
    instructions, workspaces, solutions = set(), set(), set()
    for seed in range(12):
        root = generate_task(family, seed, tmp_path)
        instructions.add((root / "instruction.md").read_text())
        workspaces.add(tuple(sorted(tree_digest(root / "environment" / "app").items())))
        solutions.add(tuple(sorted(tree_digest(root / "solution").items())))
    assert len(instructions) >= 6, "too few distinct instructions over 12 seeds"
    assert len(workspaces) >= 4, "too few distinct starting workspaces over 12 seeds"
    assert len(solutions) >= 6, "too few distinct reference solutions over 12 seeds"


@pytest.mark.sandbox
@needs_bwrap
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_oracle_scores_one_and_untouched_zero(family, tmp_path):
    for seed in (0,):
        root = generate_task(family, seed, tmp_path)
        assert harbor_oracle.check_task(root) == []


@pytest.mark.sandbox
@pytest.mark.slow
@needs_bwrap
def test_oracle_many_seeds(tmp_path):
    """Seeds 1..11 of every family (the fast test covers seed 0)."""
    import concurrent.futures

    roots = [generate_task(f, s, tmp_path) for f in sorted(FAMILIES) for s in range(1, 12)]
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        problems = [p for ps in pool.map(harbor_oracle.check_task, roots) for p in ps]
    assert not problems, "\n\n".join(problems)
