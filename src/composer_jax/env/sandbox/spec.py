"""`EnvSpec`: the Python environment a build is asked for (the interpreter, the requirements, the
app install, a resolution as of a date or exact pins). `pyenv.py` builds it; a task's
`[environment]` table is read into one by `env/tasks/envspec.py`, where each field is explained.

It is the builder's type, here in the sandbox package, so that the builder never imports the task
format (`env/tasks/` imports the sandbox to grade and validate: a spec over there made the two
packages a circle). This module imports nothing, so reading a task loads no sandbox machinery.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class EnvSpec:
    """A Python environment to build (the fields: `env/tasks/envspec.py`, the `[environment]` table)."""

    python: str | None
    requirements: tuple[str, ...]
    install_app: str = "none"
    app_version: str | None = None
    exclude_newer: str | None = None  # RFC 3339, UTC ("2024-03-13T12:00:00Z")
    pins: tuple[str, ...] = ()
