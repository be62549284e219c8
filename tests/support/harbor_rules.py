"""Harbor's default lint rules, as they apply to this repository's task layout (stdlib only).

Harbor's linter (`harbor lint TASK_DIR...`, Harbor 0.26) needs Python 3.12; this checks the same
default rules where that is not installed, written from the rules' documented meaning:

  invalid-task-config / unknown-config-field  task.toml parses; every key is one of Harbor's
                       TaskConfig fields (`[metadata]` is free-form)
  invalid-task-files   instruction.md (non-empty), environment/, tests/test.sh exist
  shared-verifier      `[verifier] environment_mode = "separate"` (Harbor's default is "shared")
  unpinned-python-dependency  every `pip install` in the Dockerfile's RUN lines and the task's
                       scripts names exact `==` versions
  verifier-runtime-install / verifier-network-download  tests/test.sh installs no pytest and
                       downloads nothing (curl, wget, git clone)
  agent-image-test-leak  environment/Dockerfile copies no tests/ or solution/ file
  unused-harborignore, compose-*, overlapping-artifacts, artifact-log-overlap: the files and keys
                       they concern (.harborignore, docker-compose.yaml, artifacts) are absent

`findings(task_dir)` returns "rule: detail" strings; [] is clean.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

# Harbor 0.26's TaskConfig fields (harbor.models.task.config), plus the spellings its linter
# accepts besides them (`version`; `memory`, `storage` in [environment]).
TOP = {
    "version", "schema_version", "task", "metadata", "verifier", "agent", "environment", "solution",
    "source", "multi_step_reward_strategy", "steps", "artifacts",
}  # fmt: skip
SECTIONS = {
    "verifier": {
        "network_mode", "allowed_hosts", "timeout_sec", "env", "user", "environment_mode", "environment",
        "collect",
    },
    "agent": {"network_mode", "allowed_hosts", "timeout_sec", "user"},
    "environment": {
        "network_mode", "allowed_hosts", "build_timeout_sec", "docker_image", "os", "cpus", "memory_mb",
        "storage_mb", "gpus", "gpu_types", "tpu", "mcp_servers", "env", "skills_dir", "healthcheck", "workdir",
        "allow_internet", "memory", "storage",
    },
    "solution": {"env"},
}  # fmt: skip


def _config_findings(task: Path) -> list[str]:
    try:
        config = tomllib.loads((task / "task.toml").read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        return [f"invalid-task-config: task.toml: {exc}"]
    out = [f"unknown-config-field: {key!r}" for key in config if key not in TOP]
    for section, known in SECTIONS.items():
        table = config.get(section, {})
        if not isinstance(table, dict):
            out.append(f"invalid-task-config: [{section}] is not a table")
            continue
        out += [f"unknown-config-field: {section}.{key}" for key in table if key not in known]
    if config.get("verifier", {}).get("environment_mode") != "separate":
        out.append('shared-verifier: [verifier] environment_mode is not "separate"')
    if "artifacts" in config or "steps" in config:
        out.append("overlapping-artifacts: artifacts/steps need Harbor's own linter")
    return out


def _file_findings(task: Path) -> list[str]:
    out = []
    instruction = task / "instruction.md"
    if not instruction.is_file() or not instruction.read_text().strip():
        out.append("invalid-task-files: instruction.md is missing or empty")
    if not (task / "environment").is_dir():
        out.append("invalid-task-files: environment/ is missing")
    if not (task / "tests" / "test.sh").is_file():
        out.append("invalid-task-files: tests/test.sh is missing")
    for path in task.rglob("*"):
        if path.name == ".harborignore" and path.parent.name not in ("tests", "solution"):
            out.append(f"unused-harborignore: {path.relative_to(task)}")
        if path.name == "docker-compose.yaml":
            out.append(f"compose-*: {path.relative_to(task)} needs Harbor's own linter")
    return out


def _logical_lines(text: str) -> list[str]:
    """Lines with backslash continuations joined and comments dropped."""
    out, pending = [], ""
    for raw in text.splitlines():
        if not pending and (not raw.strip() or raw.lstrip().startswith("#")):
            continue
        if raw.rstrip().endswith("\\"):
            pending += raw.rstrip()[:-1] + " "
            continue
        out.append(pending + raw)
        pending = ""
    return out + ([pending] if pending else [])


def _pip_packages(line: str) -> list[str]:
    """Packages named by each `pip install` / `python -m pip install` in a shell line."""
    try:
        words = shlex.split(line.replace(";", " ; ").replace("&&", " ; ").replace("||", " ; "))
    except ValueError:
        return []
    packages: list[str] = []
    installing, skip_value, prev = False, False, ""
    for word in words:
        if word == ";":
            installing = False
        elif installing:
            if skip_value:
                skip_value = False
            elif word in ("-r", "-c", "--requirement", "--constraint", "-i", "--index-url", "-t", "--target"):
                skip_value = True
            elif not word.startswith("-"):
                packages.append(word)
        elif word == "install" and prev in ("pip", "pip3"):
            installing = True
        prev = word
    return packages


def _script_findings(path: Path, *, dockerfile: bool, verifier: bool) -> list[str]:
    out = []
    for line in _logical_lines(path.read_text()):
        command = line
        if dockerfile:
            instruction, _, command = line.strip().partition(" ")
            if instruction.upper() in ("COPY", "ADD") and re.search(r"(^|[\s/])(tests|solution)/", command):
                out.append(f"agent-image-test-leak: {path.name}: {line.strip()}")
            if instruction.upper() != "RUN":
                continue
        for package in _pip_packages(command):
            if not re.fullmatch(r"[A-Za-z0-9._\[\],-]+===?[A-Za-z0-9.+!-]+", package):
                out.append(f"unpinned-python-dependency: {path.name}: {package}")
            if verifier and re.split(r"[<>=!~\[]", package)[0].lower() in ("pytest", "pytest-json-ctrf"):
                out.append(f"verifier-runtime-install: {path.name}: {package}")
        if verifier and re.search(r"\b(curl|wget)\b|\bgit\s+clone\b", command):
            out.append(f"verifier-network-download: {path.name}: {line.strip()}")
    return out


def findings(task: Path) -> list[str]:
    """Everything Harbor's default rules would flag in the task directory `task`, as far as this
    repository's tasks can trigger them."""
    out = _config_findings(task) + _file_findings(task)
    dockerfile = task / "environment" / "Dockerfile"
    if dockerfile.is_file():
        out += _script_findings(dockerfile, dockerfile=True, verifier=False)
    for script, verifier in ((task / "tests" / "test.sh", True), (task / "solution" / "solve.sh", False)):
        if script.is_file():
            out += _script_findings(script, dockerfile=False, verifier=verifier)
    return out
