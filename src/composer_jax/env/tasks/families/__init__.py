"""Parametrised task families: many small, learnable Harbor-format coding tasks from a seed.

The bundled suite under ``tasks/`` is hand-written; this package *generates* tasks for the RL demo,
where many variants of a few kinds of task are wanted. Every generated task follows the same
contract as the bundled ones (Harbor layout)::

    TASK_ID/
      task.toml              version, [metadata], [verifier], [agent], [environment]
      instruction.md         terse user request
      environment/Dockerfile
      environment/app/...    initial workspace (mounted at /app)
      tests/test.sh          verifier entry point: runs tests/run_tests.py (tasks/verifier.py), cwd /app,
                             /tests read-only; writes /logs/verifier/verdicts.json and reward.txt
      tests/run_tests.py     the verifier: per-test verdicts of every hidden test
      tests/test_outputs.py  hidden tests (pytest)
      solution/solve.sh      reference change: cwd /app, /solution read-only

API::

    FAMILIES: dict[str, Family]
    generate_task(family, seed, dest) -> Path   # writes dest/<family>-<seed>/ and returns it

Layout: ``base`` holds what all families share (the ``Family`` record, ``TaskSpec``, the Harbor
boilerplate, materialisation, the seeded rng); each family is one module named after it, exposing
``FAMILY`` and ``generate(rng, seed) -> TaskSpec``. A new family is a new module listed in
``_MODULES`` below.

Generation is deterministic: the same (family, seed) gives a byte-identical task directory.
Standard library only (the environment server runs without JAX).
"""

from __future__ import annotations

import pathlib

from . import add_cli_flag, config_repair, disable_debug, implement_spec, off_by_one, rename_api, set_constant
from .base import DOCKERFILE, TEST_SH, Family, Generator, materialise, seeded_rng

__all__ = ["Family", "FAMILIES", "generate_task", "task_id_for", "TEST_SH", "DOCKERFILE"]

# Registry order is the listing order of FAMILIES (callers sort it where order matters).
_MODULES = (off_by_one, implement_spec, rename_api, add_cli_flag, config_repair, set_constant, disable_debug)

FAMILIES: dict[str, Family] = {m.FAMILY.name: m.FAMILY for m in _MODULES}

_GENERATORS: dict[str, Generator] = {m.FAMILY.name: m.generate for m in _MODULES}


def task_id_for(family: str, seed: int) -> str:
    """The directory name generate_task uses: ``<family>-<seed>``."""
    return f"{family}-{seed}"


def generate_task(family: str, seed: int, dest: pathlib.Path | str) -> pathlib.Path:
    """Write the task (family, seed) as ``dest/<family>-<seed>/`` and return that path.

    ``dest`` is the parent directory (created if needed); an existing task directory of the same
    id is replaced. Deterministic: equal arguments give byte-identical files.
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown task family {family!r}; accepted: {', '.join(sorted(FAMILIES))}")
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be a non-negative int, got {seed!r}")
    spec = _GENERATORS[family](seeded_rng(family, seed), seed)
    root = pathlib.Path(dest) / task_id_for(family, seed)
    materialise(spec, root)
    return root
