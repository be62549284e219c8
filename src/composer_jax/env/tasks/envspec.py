"""A task's `[environment]` table in task.toml: the Python environment it declares.

    [environment]
    python = "3.11"                      # optional; default: the sandbox's python3
    requirements = ["attrs==23.2.0"]     # pip requirement lines, and/or
    requirements_file = "environment/requirements.txt"
    install_app = "editable"             # or "none" (default): pip install -e of environment/app
    app_version = "1.4.0"                # the version a VCS-versioned project builds with (no .git)
    exclude_newer = "2024-03-13T12:00:00Z"  # resolve with files uploaded before this instant only
    pins = ["pytest==8.4.2", "pluggy==1.6.0"]  # the exact set that resolution gave: installed as is

`exclude_newer` is a resolution as of a date (the commit's, for a mined task: SWE-bench's
per-version environments, by date): `requirements` are resolved by uv's `--exclude-newer` against
the index's upload times (PEP 700). `pins` is what that resolution installed, name==version for
every distribution of the environment (pytest included when it was resolved): a spec with pins
installs exactly them (`--no-deps`) and resolves nothing, so the task rebuilds identically.
`app_version` is given to the build as SETUPTOOLS_SCM_PRETEND_VERSION (setuptools-scm, and
hatch-vcs through it): a task's workspace has no .git to read a version from.

This module reads what a task says into an `EnvSpec`; the spec type is the builder's
(`env/sandbox/spec.py`, a plain dataclass importing nothing), which `env/sandbox/pyenv.py` builds:
the task format depends on the sandbox, never the other way (they were a circle of packages).
"""

from __future__ import annotations

import datetime
import re
from pathlib import Path
from typing import Any

from composer_jax.env.api.errors import TaskError
from composer_jax.env.sandbox.spec import EnvSpec

INSTALL_APP = ("none", "editable")
_PYTHON_RE = re.compile(r"^3\.\d{1,2}$")
_KEYS = ("python", "requirements", "requirements_file", "install_app", "app_version", "exclude_newer", "pins")
_PIN_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*==[A-Za-z0-9][A-Za-z0-9.+!_-]*$")
_VERSION_RE = re.compile(r"^[0-9][A-Za-z0-9.+!_-]*$")


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
    return EnvSpec(
        python,
        tuple(requirements),
        install_app,
        app_version=_app_version(table.get("app_version"), where),
        exclude_newer=_exclude_newer(table.get("exclude_newer"), where),
        pins=_pins(table.get("pins", []), where),
    )


def _app_version(value: Any, where: str) -> str | None:
    if value is not None and (not isinstance(value, str) or not _VERSION_RE.match(value)):
        raise TaskError(f'{where}: [environment] app_version = {value!r} must be a version string such as "1.4.0"')
    return value


def utc_instant(value: str) -> str:
    """`value` (an ISO 8601 / RFC 3339 date or date-time) as "YYYY-MM-DDTHH:MM:SSZ"; ValueError if it
    is none. A date alone is its midnight UTC; a time without an offset is UTC."""
    when = datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))
    if when.tzinfo is None:
        when = when.replace(tzinfo=datetime.UTC)
    return when.astimezone(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _exclude_newer(value: Any, where: str) -> str | None:
    if value is None:
        return None
    try:
        if not isinstance(value, str):
            raise ValueError(value)
        return utc_instant(value)
    except ValueError:
        raise TaskError(
            f"{where}: [environment] exclude_newer = {value!r} must be an RFC 3339 date-time such as "
            '"2024-03-13T12:00:00Z" (or a date, "2024-03-13")'
        ) from None


def _pins(value: Any, where: str) -> tuple[str, ...]:
    if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
        raise TaskError(f'{where}: [environment] pins = {value!r:.80} must be a list such as ["attrs==23.2.0"]')
    for pin in value:
        if not _PIN_RE.match(pin.strip()):
            raise TaskError(
                f"{where}: [environment] pins: {pin!r:.80} is not an exact pin; accepted: name==version "
                "(e.g. 'pytest==8.4.2'), what a resolution as of `exclude_newer` installed"
            )
    return tuple(p.strip() for p in value)
