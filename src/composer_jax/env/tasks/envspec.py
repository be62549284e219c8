"""A task's `[environment]` table in task.toml: the Python environment it declares.

    [environment]
    python = "3.11"                      # optional; default: the sandbox's python3
    requirements = ["attrs==23.2.0"]     # pip requirement lines, and/or
    requirements_file = "environment/requirements.txt"
    install_app = "editable"             # or "none" (default): pip install -e of environment/app

This is what a task says; `env/sandbox/pyenv.py` builds it. The spec sits with the task format (not
with the builder) so that reading a task never imports the sandbox.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from composer_jax.env.api.errors import TaskError

INSTALL_APP = ("none", "editable")
_PYTHON_RE = re.compile(r"^3\.\d{1,2}$")
_KEYS = ("python", "requirements", "requirements_file", "install_app")


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """A task's `[environment]` Python environment (see the module docstring)."""

    python: str | None
    requirements: tuple[str, ...]
    install_app: str = "none"


def _requirement_lines(value: Any, where: str, key: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise TaskError(f'{where}: [environment] {key} = {value!r:.80} must be a list of strings such as ["attrs>=23"]')
    lines = []
    for raw in value:
        line = raw.split(" #", 1)[0].strip() if not raw.lstrip().startswith("#") else ""
        if not line:
            continue
        if line.startswith("-") or "\n" in line:
            raise TaskError(
                f"{where}: [environment] {key}: {raw!r:.80} is not a requirement; only requirement specifiers "
                "(PEP 508, e.g. 'attrs==23.2.0') are accepted, no pip options (-r, -e, --index-url): the "
                "package source is the server's --wheelhouse or --index-url"
            )
        lines.append(line)
    return lines


def parse_environment(table: dict, task_root: Path, where: str) -> EnvSpec | None:
    """The Python environment `[environment]` declares; None when it declares none of `_KEYS`
    (Harbor's own keys there, cpus, memory_mb..., are parsed by tasks.py). TaskError names the
    bad key and what is accepted."""
    if not any(k in table for k in _KEYS):
        return None
    python = table.get("python")
    if python is not None and (not isinstance(python, str) or not _PYTHON_RE.match(python)):
        raise TaskError(f'{where}: [environment] python = {python!r} must be a version "3.N" such as "3.11"')
    requirements = _requirement_lines(table.get("requirements", []), where, "requirements")
    req_file = table.get("requirements_file")
    if req_file is not None:
        if not isinstance(req_file, str) or not req_file:
            raise TaskError(f"{where}: [environment] requirements_file = {req_file!r} must be a path in the task")
        root = Path(task_root).resolve()
        path = (root / req_file).resolve()
        if not path.is_relative_to(root):
            raise TaskError(f"{where}: [environment] requirements_file = {req_file!r} is outside the task directory")
        if not path.is_file():
            raise TaskError(f"{where}: [environment] requirements_file = {req_file!r}: no such file in the task")
        text = path.read_text(encoding="utf-8", errors="replace").splitlines()
        requirements += _requirement_lines(text, where, f"requirements_file {req_file!r}")
    install_app = table.get("install_app", "none")
    if install_app not in INSTALL_APP:
        raise TaskError(
            f"{where}: [environment] install_app = {install_app!r}; accepted: {', '.join(repr(x) for x in INSTALL_APP)}"
        )
    return EnvSpec(python, tuple(requirements), install_app)
