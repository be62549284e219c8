"""What a grade trusts: the agent's change is carried as a patch onto the task's pristine workspace
(`sandbox/snapshot.py`, in the sandbox), the patch's Python is read for runner levers
(`sandbox/levers.py`), and the reward reads the verifier's per-test verdicts (`tasks/verifier.py`).

`grade_policy` is what the in-sandbox carrier is told about a task (which test-infrastructure files
are its subject, which files it grades, whether the shadow rule applies); `VERIFIER_ENV` what the
verifier run gets on top of the sandbox's variables; `verdicts_expected` whether the task's verifier
is this project's (its reward is then read from verdicts.json, never from reward.txt);
`reward_json_trusted` whether a task's verifier writes reward.json itself (else one found is the
tests' and is refused, class "reward-write"). docs/env_protocol.md, "What a grade trusts", has the
whole boundary.
"""

from __future__ import annotations

import json
from pathlib import Path

from composer_jax.env.sandbox import levers
from composer_jax.env.tasks import verifier
from composer_jax.env.tasks.store import Task

LEVERS_SOURCE = Path(levers.__file__).read_text()

# Tampering classes: each `tampering` entry of a grade names one, and any entry makes the reward 0.
# The lever classes are read from the patch's Python (levers.CLASSES); the others after the run.
CLASSES = (*levers.CLASSES, "verdict-forge", "reward-write")
# What a grade does not carry from the workspace (each `excluded` entry names one; no penalty).
EXCLUDED = (
    "symlink",
    "bytecode",
    "binary",
    "large",
    "vcs",
    "cache",
    "startup-hook",
    "conftest",
    "test-config",
    "test-file",
    "runner-shadow",
    "truncated",  # the last entry of a list cut at snapshot.MAX_EXCLUDED: how many more
)


def verifier_env(task: Task) -> dict[str, str]:
    """Variables every verifier run gets: no user site, no startup file, no autoloaded pytest
    plugins except the ones task.toml `[verifier] pytest_plugins` names (loaded by name)."""
    return {
        "PYTHONNOUSERSITE": "1",
        "PYTHONSTARTUP": "",
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        "PYTEST_PLUGINS": ",".join(task.config.pytest_plugins),
    }


def _read(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def verdicts_expected(task: Task) -> bool:
    """Whether the task's verifier is this project's (`tests/test.sh` runs `tests/run_tests.py`,
    which declares verifier.FORMAT): its reward is then verdicts.json's, read per test."""
    marker = f"FORMAT = {verifier.FORMAT!r}".replace("'", '"')
    return "run_tests.py" in _read(task.tests_dir / "test.sh") and marker in _read(task.tests_dir / "run_tests.py")


def reward_json_trusted(task: Task) -> bool:
    """Whether the task's verifier writes reward.json (its tests/test.sh names it). A reward.json
    under any other verifier was written by the code under test."""
    return "reward.json" in _read(task.tests_dir / "test.sh")


def graded_test_files(task: Task) -> list[str]:
    """The workspace paths a repository task's verifier owns (tests/config.json `test_files` and
    `deleted`, and every file of its test overlay tests/files/): never carried from the workspace."""
    try:
        config = json.loads(_read(task.tests_dir / "config.json") or "{}")
    except ValueError:
        config = {}
    files = [f for key in ("test_files", "deleted") for f in config.get(key, []) if isinstance(f, str)]
    overlay = task.tests_dir / "files"
    if overlay.is_dir():
        files += [p.relative_to(overlay).as_posix() for p in sorted(overlay.rglob("*")) if not p.is_dir()]
    return sorted(set(files))


def grade_policy(task: Task) -> dict:
    """What the in-sandbox carrier (snapshot.Carrier) is told about `task`."""
    return {
        "code_under_test": list(task.config.code_under_test),
        "test_files": graded_test_files(task),
        "shadow_rule": not verdicts_expected(task),
    }


def lever_entries(found: list[dict]) -> list[dict]:
    """Tampering entries for levers the scanner found: {path, line, class, what, code, action}."""
    keys = ("path", "line", "what", "code")
    return [{**{k: f.get(k) for k in keys}, "class": f.get("lever"), "action": "refused"} for f in found[:50]]


def tampering_error(tampering: list[dict]) -> str:
    """The grade's error for a change that tampered with grading (its reward is 0)."""
    shown = ", ".join(
        f"{t['path']}{':' + str(t['line']) if t.get('line') else ''} ({t['class']}"
        + (f": {t['what']}" if t.get("what") else "")
        + ")"
        for t in tampering[:10]
    )
    more = f" and {len(tampering) - 10} more" if len(tampering) > 10 else ""
    return f"the change tampered with grading: {shown}{more}; reward 0 (docs/env_protocol.md, What a grade trusts)"
