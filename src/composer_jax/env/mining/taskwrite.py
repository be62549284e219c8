"""Writing a repository-derived task (mined or imported) as a Harbor task directory.

The layout (docs/tasks.md): `environment/app/` is the repository at the base commit without the
test patch; `tests/files/` the test patch's files as they are after it, `tests/config.json` the
test files to run, the files the patch deletes and the FAIL_TO_PASS / PASS_TO_PASS node ids;
`tests/run_tests.py` the verifier (`tasks/verifier.py`), `tests/test.sh` its entry point;
`solution/solution.patch` the non-test change, applied by `solution/solve.sh` with `git apply`;
`task.toml` carries where the task came from ([metadata]) so evaluation can group by repository
and category and decontaminate by date.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import shutil
import tempfile
from pathlib import Path

from composer_jax.env.mining import gitrepo
from composer_jax.env.sandbox.spec import EnvSpec
from composer_jax.env.tasks import verifier
from composer_jax.env.tasks.families.base import write_verifier

CATEGORIES = ("bug fix", "feature", "refactor", "tests")
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")

SOLVE_SH = """#!/usr/bin/env bash
# Reference solution: the commit's non-test change.
set -euo pipefail
cd /app
git apply --whitespace=nowarn /solution/solution.patch
"""


def harness_safe(text: str) -> str:
    """An id made of [A-Za-z0-9_.-] (what SWE-bench harnesses accept in instance ids and paths)."""
    return _UNSAFE.sub("_", text).strip("._") or "task"


@dataclasses.dataclass
class RepoTask:
    """What a repository-derived task is made of; `write_task` lays it out."""

    task_id: str
    instance_id: str
    repo: str
    base_commit: str
    commit_date: str
    category: str
    instruction: str
    test_patch: bytes
    solution_patch: bytes
    test_files: list[str]  # the test modules pytest runs
    fail_to_pass: list[str] = dataclasses.field(default_factory=list)
    pass_to_pass: list[str] = dataclasses.field(default_factory=list)
    solution_commit: str | None = None
    source: str = "mined"
    changed_files: int = 0
    changed_lines: int = 0
    environment: dict = dataclasses.field(default_factory=dict)  # extra [environment] keys
    dockerfile: str | None = None
    extra_metadata: dict = dataclasses.field(default_factory=dict)
    verifier_timeout_s: float = 300.0
    pytest_plugins: list[str] = dataclasses.field(default_factory=list)  # [verifier]: its environment's plugins

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES:
            raise ValueError(f"category {self.category!r}; accepted: {', '.join(CATEGORIES)}")


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(value, (list, tuple)):
        if not value:
            return "[]"
        return "[\n" + "".join(f"  {_toml_value(v)},\n" for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} to task.toml")


def _table(name: str, values: dict) -> str:
    return f"[{name}]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in values.items() if v is not None)


def task_toml(t: RepoTask) -> str:
    metadata = {
        "author_name": f"composer-jax env {'mine' if t.source == 'mined' else 'import-swebench'}",
        "source": t.source,
        "category": t.category,
        "tags": ["python", t.source],
        "repo": t.repo,
        "instance_id": t.instance_id,
        "base_commit": t.base_commit,
        "solution_commit": t.solution_commit,
        "commit_date": t.commit_date,
        "fail_to_pass": list(t.fail_to_pass),
        "pass_to_pass": list(t.pass_to_pass),
        "changed_files": t.changed_files,
        "changed_lines": t.changed_lines,
        **t.extra_metadata,
    }
    environment = {"build_timeout_sec": 600.0, "cpus": 1, "memory_mb": 2048, "storage_mb": 2048, **t.environment}
    verifier = {"environment_mode": "separate", "timeout_sec": t.verifier_timeout_s}
    verifier |= {"pytest_plugins": list(t.pytest_plugins)} if t.pytest_plugins else {}
    return "\n".join(
        [
            'version = "1.0"\n',
            _table("metadata", metadata),
            _table("verifier", verifier),
            _table("agent", {"timeout_sec": 1800.0}),
            _table("environment", environment),
        ]
    )


def default_dockerfile(spec: EnvSpec | None = None) -> str:
    """A Dockerfile equivalent to what the local sandbox runs: the spec's Python (else 3.11), pytest,
    the spec's requirements, and the app installed editable at /app when the spec says so, so
    Harbor's own runners build the same environment the server's env cache builds (pyenv.py)."""
    import pytest

    python = spec.python if spec is not None and spec.python else "3.11"
    lines = [
        f"FROM python:{python}-slim",
        "RUN apt-get update && apt-get install -y --no-install-recommends git && rm -rf /var/lib/apt/lists/*",
        "WORKDIR /app",
    ]
    pins = spec.pins if spec is not None else ()
    if not any(p.lower().startswith("pytest==") for p in pins):
        lines.append(f"RUN pip install --no-cache-dir pytest=={pytest.__version__}")
    if pins:  # what the resolution as of `exclude_newer` installed: exactly these, nothing resolved
        lines.append("RUN pip install --no-cache-dir --no-deps " + " ".join(shlex.quote(r) for r in pins))
    elif spec is not None and spec.requirements:
        lines.append("RUN pip install --no-cache-dir " + " ".join(shlex.quote(r) for r in spec.requirements))
    if spec is not None and spec.app_version:
        lines.append(f"ENV SETUPTOOLS_SCM_PRETEND_VERSION={spec.app_version}")
    lines.append("COPY app/ /app/")
    if spec is not None and spec.install_app == "editable":
        lines.append("RUN pip install --no-cache-dir -e /app")
    return "\n".join(lines) + "\n"


def split_test_patch(base_tree: Path, test_patch: bytes) -> tuple[dict[str, Path], list[str], Path]:
    """Apply the test patch to a copy of `base_tree`: ({path: file after the patch}, deleted paths, copy).

    The caller removes the copy's parent directory."""
    tmp = Path(tempfile.mkdtemp(prefix="composer-jax-testpatch-"))
    copy = tmp / "tree"
    shutil.copytree(base_tree, copy, symlinks=True)
    gitrepo.apply(copy, test_patch)
    files, deleted = {}, []
    for path in patched_paths(test_patch):
        target = copy / path
        if target.is_file() or target.is_symlink():
            files[path] = target
        else:
            deleted.append(path)
    return files, deleted, copy


def environment_of(requirements: list[str]) -> dict:
    """The [environment] keys of a task whose project declares `requirements` ({} for none)."""
    return {"requirements": requirements} if requirements else {}


def with_pins(t: RepoTask, installed: tuple[str, ...]) -> RepoTask:
    """`t` with its environment's resolution as of `exclude_newer` recorded as `pins` (the build's
    exact result, so the task rebuilds identically); `t` itself when it was not resolved by date
    or nothing was installed (every requirement came with the verifier's toolchain)."""
    if not t.environment.get("exclude_newer") or not installed:
        return t
    return dataclasses.replace(t, environment={**t.environment, "pins": list(installed)})


def patched_paths(patch: bytes) -> list[str]:
    """The paths a `git diff` touches (its b/ side, or a/ for a deletion)."""
    paths = []
    for line in patch.decode("utf-8", "replace").splitlines():
        if line.startswith("diff --git "):
            match = re.match(r"diff --git a/(.+) b/(.+)$", line)
            if match and match.group(2) not in paths:
                paths.append(match.group(2))
    return paths


def write_task(t: RepoTask, base_tree: Path, out_root: Path) -> Path:
    """Lay out `t` under `out_root/t.task_id` (replacing a partial earlier write) and return it."""
    root = out_root / t.task_id
    if root.exists():
        shutil.rmtree(root)
    (root / "environment").mkdir(parents=True)
    shutil.copytree(base_tree, root / "environment" / "app", symlinks=True)
    spec = EnvSpec(
        python=t.environment.get("python"),
        requirements=tuple(t.environment.get("requirements", ())),
        install_app=t.environment.get("install_app", "none"),
        app_version=t.environment.get("app_version"),
        exclude_newer=t.environment.get("exclude_newer"),
        pins=tuple(t.environment.get("pins", ())),
    )
    (root / "environment" / "Dockerfile").write_text(t.dockerfile or default_dockerfile(spec))
    (root / "instruction.md").write_text(t.instruction.rstrip() + "\n")
    (root / "task.toml").write_text(task_toml(t))
    solution = root / "solution"
    solution.mkdir()
    (solution / "solution.patch").write_bytes(t.solution_patch)
    (solution / "solve.sh").write_text(SOLVE_SH)
    tests = root / "tests"
    files, deleted, copy = split_test_patch(base_tree, t.test_patch)
    try:
        for rel, src in files.items():
            dest = tests / "files" / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest, follow_symlinks=False)
    finally:
        shutil.rmtree(copy.parent, ignore_errors=True)
    config = {
        "test_files": t.test_files,
        "deleted": deleted,
        "fail_to_pass": t.fail_to_pass,
        "pass_to_pass": t.pass_to_pass,
        "rule": "swebench" if t.source == "swebench" else "passed",
        "own_modules": verifier.own_modules(base_tree),
    }
    (tests / "config.json").write_text(json.dumps(config, indent=1))
    write_verifier(tests, max(10.0, t.verifier_timeout_s - 10))
    (solution / "solve.sh").chmod(0o755)
    return root
