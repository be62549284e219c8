"""What every task family shares: the Harbor boilerplate, the task spec, materialisation, the seeded rng.

A family module builds a :class:`TaskSpec` (the task's text: instruction, workspace, hidden tests,
reference solution, metadata) from a seeded ``random.Random``; :func:`materialise` writes it in the
Harbor layout. Everything that is the same for all generated tasks (Dockerfile, verifier script,
``task.toml`` fields other than difficulty/category/tags, file modes) lives here, so families differ
only in what they generate.

Standard library only (the environment server runs without JAX).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import random
import shutil
import textwrap
from collections.abc import Callable

__all__ = [
    "Family",
    "TaskSpec",
    "Generator",
    "DOCKERFILE",
    "PYTEST_REQUIREMENT",
    "TEST_SH",
    "VERIFIER_SOURCE",
    "test_sh",
    "write_verifier",
    "SOLVE_SH_COPY",
    "task_toml",
    "dedent",
    "materialise",
    "seeded_rng",
    "run_source",
]


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    description: str
    kind: str  # debugging | feature | refactor | devops | tests | ...


# ----------------------------------------------------------------------------------------------
# Shared task boilerplate (also used verbatim by the bundled suite under tasks/).

# Harbor builds this image for the agent and, with `[verifier] environment_mode = "separate"`, a
# fresh one for the verifier. pytest is pinned (Harbor's linter: unpinned-python-dependency) to the
# version locks/base.lock pins, which the local sandbox runs the tests with.
PYTEST_REQUIREMENT = "pytest==9.2.0"
DOCKERFILE = f"""\
FROM python:3.11-slim
WORKDIR /app
RUN pip install --no-cache-dir {PYTEST_REQUIREMENT}
COPY app/ /app/
"""

# The verifier of every task this project writes (tasks/verifier.py), copied into the task as
# tests/run_tests.py; test.sh only runs it. It pays on per-test verdicts (docs/env_protocol.md).
VERIFIER_SOURCE = (pathlib.Path(__file__).resolve().parents[1] / "verifier.py").read_text()
VERIFIER_NAME = "run_tests.py"


def test_sh(timeout_s: float | None = None) -> str:
    """The entry point of a task whose verifier is tests/run_tests.py (with `timeout_s`, pytest's
    own limit, set some seconds inside the task's verifier timeout so the verdicts are written)."""
    limit = f" --timeout {timeout_s:g}" if timeout_s is not None else ""
    return (
        "#!/usr/bin/env bash\n"
        "# Verifier: tests/run_tests.py runs the hidden tests on /app and writes /logs/verifier/verdicts.json\n"
        "# (per-test verdicts: the reward) and reward.txt (1 iff every graded test passed).\n"
        "mkdir -p /logs/verifier\n"
        "cd /app || { echo 0 > /logs/verifier/reward.txt; exit 0; }\n"
        f"python3 -I -S /tests/{VERIFIER_NAME}{limit} || echo 0 > /logs/verifier/reward.txt\n"
        "exit 0\n"
    )


TEST_SH = test_sh()


def write_verifier(tests_dir: pathlib.Path, timeout_s: float | None = None) -> None:
    """Write the verifier (test.sh and run_tests.py) into a task's tests/ folder."""
    _write(tests_dir / "test.sh", test_sh(timeout_s), executable=True)
    _write(tests_dir / VERIFIER_NAME, VERIFIER_SOURCE)


SOLVE_SH_COPY = """\
#!/usr/bin/env bash
# Reference solution: copy the changed files over the workspace.
set -euo pipefail
cp -r /solution/app/. /app/
"""


def task_toml(*, difficulty: str, category: str, tags: list[str], agent_timeout: int = 600) -> str:
    tag_list = ", ".join(json.dumps(t) for t in tags)
    return (
        'version = "1.0"\n\n'
        "[metadata]\n"
        'author_name = "composer_jax task families"\n'
        f'difficulty = "{difficulty}"\n'
        f'category = "{category}"\n'
        f"tags = [{tag_list}]\n\n"
        # This server grades a fresh copy of the workspace: Harbor's "separate" verifier.
        '[verifier]\nenvironment_mode = "separate"\ntimeout_sec = 60.0\n\n'
        f"[agent]\ntimeout_sec = {float(agent_timeout)}\n\n"
        "[environment]\nbuild_timeout_sec = 300.0\ncpus = 1\nmemory_mb = 1024\nstorage_mb = 1024\n"
    )


@dataclasses.dataclass
class TaskSpec:
    """One generated task, before it is written out (paths are relative to the folder named)."""

    instruction: str
    app: dict[str, str]  # the initial workspace (/app)
    tests: dict[str, str]  # hidden tests (/tests), next to the shared test.sh
    solution: dict[str, str]  # files copied over /app by solve.sh (paths relative to /app)
    difficulty: str
    category: str
    tags: list[str]
    solve_sh: str = SOLVE_SH_COPY


# A family's generator: (seeded rng, seed) -> the task. All randomness must come from the rng, so
# that the same (family, seed) gives the same task.
Generator = Callable[[random.Random, int], TaskSpec]


def dedent(s: str) -> str:
    """``textwrap.dedent`` for the indented triple-quoted sources the families embed, minus the first newline."""
    return textwrap.dedent(s).lstrip("\n")


def _write(path: pathlib.Path, text: str, executable: bool = False) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(text.encode("utf-8"))
    path.chmod(0o755 if executable else 0o644)


def materialise(spec: TaskSpec, root: pathlib.Path) -> None:
    """Write ``spec`` as the Harbor task directory ``root``, replacing whatever is there."""
    if root.exists():
        shutil.rmtree(root)
    root.mkdir(parents=True)
    _write(root / "task.toml", task_toml(difficulty=spec.difficulty, category=spec.category, tags=spec.tags))
    _write(root / "instruction.md", spec.instruction.rstrip("\n") + "\n")
    _write(root / "environment" / "Dockerfile", DOCKERFILE)
    for rel, text in sorted(spec.app.items()):
        _write(root / "environment" / "app" / rel, text)
    write_verifier(root / "tests")
    for rel, text in sorted(spec.tests.items()):
        _write(root / "tests" / rel, text)
    _write(root / "solution" / "solve.sh", spec.solve_sh, executable=True)
    for rel, text in sorted(spec.solution.items()):
        _write(root / "solution" / "app" / rel, text)


def seeded_rng(family: str, seed: int) -> random.Random:
    # The string (not this module's name) fixes every generated task: changing it changes them all.
    return random.Random(f"composer_jax.task_families:{family}:{seed}")


def run_source(source: str, label: str) -> dict:
    """Execute a generated module's source and return its namespace.

    Families use it to compute the values their instructions and hidden tests quote (what the
    buggy and the fixed code return) from the very code they write into the task.
    """
    namespace: dict = {}
    exec(compile(source, label, "exec"), namespace)
    return namespace
