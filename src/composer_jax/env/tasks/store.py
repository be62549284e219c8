"""Harbor-layout coding tasks on disk: loading, validation and the task store.

A task is a directory ``TASK_ID/``::

    task.toml            Harbor configuration (version, [metadata], [verifier], [agent], [environment]);
                         [environment] python/requirements/requirements_file/install_app declare
                         the task's own Python environment (pyenv.py), built once into the env cache
    instruction.md       what the agent is asked to do
    environment/app/     the initial workspace, copied per session and mounted at /app
    environment/Dockerfile  optional, for Harbor compatibility (the local sandbox does not build it)
    tests/test.sh        the verifier, run as `bash /tests/test.sh` with cwd /app; writes
                         /logs/verifier/reward.txt (a number) or reward.json ({"reward": x})
    solution/solve.sh    the reference solution (the oracle), run with cwd /app

Ids of on-disk tasks are their directory names. Ids ``gen/<family>`` are generated on demand by
``composer_jax.env.tasks.families.generate_task(family, seed, dest)`` (imported lazily).
"""

from __future__ import annotations

import dataclasses
import importlib
import random
import re
import threading
import tomllib
from pathlib import Path
from typing import Any

from composer_jax.env.api.errors import TaskError, UnknownTaskError
from composer_jax.env.sandbox.spec import EnvSpec
from composer_jax.env.tasks.envspec import parse_environment

TASK_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
GENERATED_PREFIX = "gen/"
MAX_SEED = 2**31 - 1
# Harbor's [verifier] environment_mode. This server grades a fresh copy of the workspace whatever
# the task says ("separate"); "shared" (Harbor's default when unset) is accepted for Harbor's sake.
VERIFIER_MODES = ("separate", "shared")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


@dataclasses.dataclass(frozen=True)
class TaskConfig:
    """The parts of Harbor's task.toml the local runner uses (other keys are kept in `raw`)."""

    version: str
    metadata: dict[str, Any]
    verifier_timeout_sec: float
    agent_timeout_sec: float
    cpus: float
    memory_mb: int
    storage_mb: int
    gpus: int
    allow_internet: bool
    raw: dict[str, Any]
    # [verifier] python_modules: what the tests import; a grade checks the sandbox's python3 has them.
    test_modules: tuple[str, ...] = ()
    # [verifier] pytest_plugins: the plugins the tests need, loaded by name (PYTEST_PLUGINS); no
    # other plugin is autoloaded into a verifier's pytest (tasks/tampering.py).
    pytest_plugins: tuple[str, ...] = ()
    # [metadata] code_under_test (metadata: Harbor's TaskConfig takes no unknown [verifier] key): glob
    # patterns (relative to /app) of test-infrastructure files that are the task's subject (a CI
    # repair's pytest configuration, a tests task's conftest.py): a grade carries the agent's edits
    # of these; of other such files it never does (sandbox/snapshot.py).
    code_under_test: tuple[str, ...] = ()
    # [environment] python / requirements / requirements_file / install_app (pyenv.py); None: none.
    environment: EnvSpec | None = None


@dataclasses.dataclass(frozen=True)
class Task:
    """A loaded task. `not_runnable_reason` is set when the local sandbox cannot run it."""

    task_id: str
    root: Path
    config: TaskConfig
    instruction: str
    not_runnable_reason: str | None

    @property
    def app_dir(self) -> Path:
        return self.root / "environment" / "app"

    @property
    def tests_dir(self) -> Path:
        return self.root / "tests"

    @property
    def solution_dir(self) -> Path:
        return self.root / "solution"

    @property
    def runnable(self) -> bool:
        return self.not_runnable_reason is None


def _number(table: dict, key: str, where: str, default: float, *, positive: bool = True) -> float:
    value = table.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TaskError(f"{where}: {key} = {value!r} is not a number; expected e.g. {key} = {default}")
    if positive and value <= 0:
        raise TaskError(f"{where}: {key} = {value!r} must be > 0")
    return float(value)


_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)i?B?\s*$", re.IGNORECASE)
_SIZE_MB = {"": 1 / (1024 * 1024), "K": 1 / 1024, "M": 1, "G": 1024, "T": 1024 * 1024}


def _megabytes(env: dict, key_mb: str, key_legacy: str, where: str, default: int) -> int:
    """Harbor spells sizes `memory_mb = 2048` (current) or `memory = "2G"` (deprecated); accept both."""
    if key_mb in env:
        return int(_number(env, key_mb, where, default))
    if key_legacy in env:
        value = env[key_legacy]
        match = _SIZE_RE.match(str(value))
        if not match:
            raise TaskError(f'{where}: {key_legacy} = {value!r} is not a size; expected e.g. "2G" or "512M"')
        return max(1, int(float(match.group(1)) * _SIZE_MB[match.group(2).upper()]))
    return default


def parse_task_config(data: dict[str, Any], where: str, root: Path | None = None) -> TaskConfig:
    """Validate a parsed task.toml. Unknown keys are allowed (Harbor ignores them too). `root`,
    the task directory, is where `[environment] requirements_file` is read from."""
    version = data.get("version", data.get("schema_version", "1.0"))
    if not isinstance(version, str):
        raise TaskError(f'{where}: version = {version!r} must be a string such as "1.0"')
    sections = {}
    for name in ("metadata", "verifier", "agent", "environment"):
        value = data.get(name, {})
        if not isinstance(value, dict):
            raise TaskError(f"{where}: [{name}] must be a table, got {type(value).__name__} {value!r}")
        sections[name] = value
    env = sections["environment"]
    gpus = env.get("gpus", 0)
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 0:
        raise TaskError(f"{where}: [environment] gpus = {gpus!r} must be an integer >= 0")
    allow_internet = env.get("allow_internet", False)
    if not isinstance(allow_internet, bool):
        raise TaskError(f"{where}: [environment] allow_internet = {allow_internet!r} must be true or false")
    tags = sections["metadata"].get("tags", [])
    if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
        raise TaskError(f"{where}: [metadata] tags = {tags!r} must be a list of strings")
    mode = sections["verifier"].get("environment_mode", "separate")
    if mode not in VERIFIER_MODES:
        raise TaskError(
            f"{where}: [verifier] environment_mode = {mode!r}; accepted: "
            f"{', '.join(repr(m) for m in VERIFIER_MODES)} (this server always grades a fresh copy)"
        )
    modules = _modules(sections["verifier"], "python_modules", where, '["pytest", "numpy"]')
    plugins = _modules(sections["verifier"], "pytest_plugins", where, '["pytest_asyncio.plugin"]')
    carried = sections["metadata"].get("code_under_test", [])
    if not isinstance(carried, list) or not all(_relative_glob(g) for g in carried):
        raise TaskError(
            f"{where}: [metadata] code_under_test = {carried!r} must be a list of glob patterns relative to "
            'the workspace, such as ["pyproject.toml", "tests/conftest.py"] (no leading "/" or "..")'
        )
    return TaskConfig(
        version=version,
        metadata=dict(sections["metadata"]),
        verifier_timeout_sec=_number(sections["verifier"], "timeout_sec", f"{where} [verifier]", 120.0),
        agent_timeout_sec=_number(sections["agent"], "timeout_sec", f"{where} [agent]", 600.0),
        cpus=_number(env, "cpus", f"{where} [environment]", 1.0),
        memory_mb=_megabytes(env, "memory_mb", "memory", f"{where} [environment]", 2048),
        storage_mb=_megabytes(env, "storage_mb", "storage", f"{where} [environment]", 1024),
        gpus=gpus,
        allow_internet=allow_internet,
        raw=data,
        test_modules=modules,
        pytest_plugins=plugins,
        code_under_test=tuple(carried),
        environment=_environment(env, root, where),
    )


def _relative_glob(pattern: object) -> bool:
    return (
        isinstance(pattern, str)
        and bool(pattern.strip())
        and not pattern.startswith("/")
        and ".." not in pattern.split("/")
        and "\\" not in pattern
    )


def _modules(verifier: dict, key: str, where: str, example: str) -> tuple[str, ...]:
    modules = verifier.get(key, [])
    if not isinstance(modules, list) or not all(isinstance(m, str) and _MODULE.fullmatch(m) for m in modules):
        raise TaskError(
            f"{where}: [verifier] {key} = {modules!r} must be a list of importable module names such as {example}"
        )
    return tuple(modules)


def _environment(env: dict, root: Path | None, where: str) -> EnvSpec | None:
    if root is None and "requirements_file" in env:
        raise TaskError(f"{where}: [environment] requirements_file needs the task directory (use load_task)")
    return parse_environment(env, root or Path("."), where)


def _not_runnable_reason(root: Path, config: TaskConfig) -> str | None:
    if config.gpus > 0:
        return f"task.toml asks for gpus = {config.gpus}; the local sandbox has no GPUs"
    if config.allow_internet:
        return "task.toml sets allow_internet = true; the local sandbox has no network"
    if not (root / "environment" / "app").is_dir():
        if (root / "environment" / "Dockerfile").is_file():
            return (
                "environment/Dockerfile builds the environment and there is no environment/app/ "
                "initial workspace for the local sandbox"
            )
        return "environment/app/ (the initial workspace mounted at /app) is missing"
    return None


def load_task(root: Path, task_id: str | None = None) -> Task:
    """Load and validate one task directory; raises TaskError naming the bad file or field."""
    root = Path(root)
    task_id = task_id or root.name
    if not root.is_dir():
        raise TaskError(f"task {task_id!r}: {root} is not a directory")
    toml_path = root / "task.toml"
    if not toml_path.is_file():
        raise TaskError(
            f"task {task_id!r}: missing task.toml (a Harbor task needs task.toml, "
            "instruction.md, environment/, tests/test.sh)"
        )
    try:
        data = tomllib.loads(toml_path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise TaskError(f"task {task_id!r}: task.toml is not valid TOML: {exc}") from None
    config = parse_task_config(data, f"task {task_id!r} task.toml", root)
    instruction_path = root / "instruction.md"
    if not instruction_path.is_file():
        raise TaskError(f"task {task_id!r}: missing instruction.md")
    instruction = instruction_path.read_text(encoding="utf-8")
    if not instruction.strip():
        raise TaskError(f"task {task_id!r}: instruction.md is empty")
    if not (root / "tests" / "test.sh").is_file():
        raise TaskError(f"task {task_id!r}: missing tests/test.sh (the verifier entry point)")
    return Task(task_id, root, config, instruction, _not_runnable_reason(root, config))


def check_seed(seed: object) -> int:
    """`seed` if it is an integer in [0, MAX_SEED]; TaskError naming it otherwise."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise TaskError(f"seed {seed!r} must be an integer in [0, {MAX_SEED}]")
    return seed


class TaskStore:
    """Resolves task ids to loaded tasks: directories under `tasks_dir` and `gen/<family>` ids.

    Generated tasks are written once per (family, seed) under `cache_dir` and reused.
    """

    def __init__(self, tasks_dir: Path | None, cache_dir: Path):
        self.tasks_dir = Path(tasks_dir) if tasks_dir is not None else None
        self.cache_dir = Path(cache_dir)
        self._tasks: dict[str, Task] = {}
        self.errors: dict[str, str] = {}  # directory name -> why it is not a valid task
        self._generated: dict[tuple[str, int], Task] = {}
        self._gen_lock = threading.Lock()
        if self.tasks_dir is not None:
            self.reload()

    def reload(self) -> None:
        assert self.tasks_dir is not None
        if not self.tasks_dir.is_dir():
            raise TaskError(f"--tasks {self.tasks_dir}: not a directory")
        tasks, errors = {}, {}
        for entry in sorted(self.tasks_dir.iterdir()):
            if not entry.is_dir() or entry.name.startswith((".", "_")):
                continue
            if not TASK_ID_RE.match(entry.name):
                errors[entry.name] = f"directory name {entry.name!r} is not a valid task id ({TASK_ID_RE.pattern})"
                continue
            try:
                tasks[entry.name] = load_task(entry)
            except TaskError as exc:
                errors[entry.name] = str(exc)
        self._tasks, self.errors = tasks, errors

    def ids(self) -> list[str]:
        return sorted(self._tasks)

    def tasks(self) -> list[Task]:
        return [self._tasks[i] for i in self.ids()]

    @staticmethod
    def families() -> list[str]:
        try:
            module = importlib.import_module("composer_jax.env.tasks.families")
        except ImportError:
            return []
        return sorted(getattr(module, "FAMILIES", {}))

    def get(self, task_id: str, seed: int | None = None) -> Task:
        """The task for `task_id` (a directory name or `gen/<family>`); TaskError if unknown."""
        if not isinstance(task_id, str) or not task_id:
            raise TaskError(f"task_id {task_id!r} must be a non-empty string")
        if seed is not None:
            check_seed(seed)
        if task_id.startswith(GENERATED_PREFIX):
            return self._generate(task_id[len(GENERATED_PREFIX) :], seed or 0)
        task = self._tasks.get(task_id)
        if task is None:
            known = ", ".join(self.ids()[:20]) or "(none)"
            more = f" and {len(self._tasks) - 20} more" if len(self._tasks) > 20 else ""
            raise UnknownTaskError(
                f"unknown task_id {task_id!r}; known tasks: {known}{more}; "
                f"generated families: {', '.join(GENERATED_PREFIX + f for f in self.families()) or '(none)'}"
            )
        return task

    def pick(self, seed: int) -> str:
        """The task id a reset without `task_id` gets: one of the runnable tasks and `gen/<family>`
        ids (sorted), chosen by `random.Random(seed)`, so a seed names the same task on any server
        with the same tasks."""
        check_seed(seed)
        candidates = [t.task_id for t in self.tasks() if t.runnable] + [GENERATED_PREFIX + f for f in self.families()]
        if not candidates:
            raise TaskError("no runnable task to pick: the task directory has none and there are no task families")
        return candidates[random.Random(seed).randrange(len(candidates))]

    def _generate(self, family: str, seed: int) -> Task:
        families = self.families()
        if family not in families:
            raise UnknownTaskError(
                f"unknown task family {family!r} in {GENERATED_PREFIX + family!r}; "
                f"accepted: {', '.join(families) or '(no composer_jax.env.tasks.families module)'}"
            )
        key = (family, seed)
        with self._gen_lock:
            if key not in self._generated:
                module = importlib.import_module("composer_jax.env.tasks.families")
                dest = self.cache_dir / "generated" / f"{family}-{seed}"
                if not (dest / "task.toml").is_file():
                    dest.parent.mkdir(parents=True, exist_ok=True)
                    root = Path(module.generate_task(family, seed, dest))
                else:
                    root = dest
                self._generated[key] = load_task(root, f"{GENERATED_PREFIX}{family}")
            return self._generated[key]
