"""What a grade trusts: the workspace is put back to the task's test infrastructure before the
verifier runs (`sandbox/sanitize.py`, in the sandbox), the verifier's interpreter is started without
the hooks a workspace could plant, and what the tests could have forged is refused.

`sanitize_job` runs the sanitizer on a grading job's copy; `VERIFIER_ENV` is what the verifier
run gets on top of the sandbox's variables; `reward_json_trusted` says whether a task's verifier
writes reward.json itself (else one found is the tests' and is refused, class "reward-write");
`runner_flags` names the places where a diff reaches into the test runner's internals (a flag, not
a failure: the residual risk of code under test that patches the runner from inside the test
process). docs/env_protocol.md, "What a grade trusts", has the whole boundary.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from composer_jax.env.sandbox import sanitize
from composer_jax.env.sandbox.runner import Limits, Mount, SandboxLease
from composer_jax.env.tasks.store import Task

SANITIZE_TIMEOUT_S = 60.0
_SANITIZE_SOURCE = Path(sanitize.__file__).read_text()

# Tampering classes (each `tampering` entry of a grade names one).
CLASSES = ("conftest", "test-config", "startup-hook", "runner-shadow", "reward-write")

# Text in an added line of the diff that reaches into the test runner from the code under test.
RUNNER_INTERNALS = {
    "_pytest": re.compile(r"\b_pytest\b"),
    "pytest hook": re.compile(r"\bpytest_(runtest|collection|configure|sessionfinish|terminal|report)\w*"),
    "sys.modules['pytest']": re.compile(r"sys\.modules\s*\[\s*['\"](pytest|_pytest|unittest)"),
    "TestCase.run": re.compile(r"TestCase\s*\.\s*(run|__call__|debug)\b"),
    "pytest.main": re.compile(r"\bpytest\s*\.\s*(main|console_main|exit)\b"),
    # after pytest wrote its report (a JUnit rewrite) or instead of its exit status
    "exit hook": re.compile(r"\batexit\s*\.\s*register\b|\bos\s*\.\s*_exit\b"),
    "verifier logs": re.compile(r"/logs/verifier|reward\.(txt|json)|junit\.xml"),
}


def verifier_env(task: Task) -> dict[str, str]:
    """Variables every verifier run gets: no user site, no startup file, no autoloaded pytest
    plugins except the ones task.toml `[verifier] pytest_plugins` names (loaded by name)."""
    return {
        "PYTHONNOUSERSITE": "1",
        "PYTHONSTARTUP": "",
        "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",
        "PYTEST_PLUGINS": ",".join(task.config.pytest_plugins),
    }


def _test_sh(task: Task) -> str:
    try:
        return (task.tests_dir / "test.sh").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return ""


def sanitize_scope(task: Task) -> str:
    """ "hooks" when the verifier's pytest is rooted at /tests (its test.sh passes `--rootdir=/tests`
    and the task has no workspace test list, tests/config.json): the workspace's conftest.py files
    and pytest configuration never load into it and are the agent's own; else "all"."""
    rooted = "--rootdir=/tests" in _test_sh(task) and not (task.tests_dir / "config.json").exists()
    return "hooks" if rooted else "all"


def reward_json_trusted(task: Task) -> bool:
    """Whether the task's verifier writes reward.json (its tests/test.sh names it). A reward.json
    under any other verifier was written by the code under test."""
    return "reward.json" in _test_sh(task)


def runner_flags(diff: str) -> list[dict]:
    """[{"path", "pattern", "line"}] for each added line of `diff` that names runner internals."""
    flags: list[dict] = []
    path = ""
    for line in diff.splitlines():
        if line.startswith("+++ "):
            path = line[6:] if line.startswith("+++ b/") else line[4:]
            continue
        if not line.startswith("+"):
            continue
        for label, pattern in RUNNER_INTERNALS.items():
            if pattern.search(line):
                flags.append({"path": path, "pattern": label, "line": line[1:].strip()[:200]})
                break
        if len(flags) >= 50:
            break
    return flags


async def sanitize_job(
    task: Task, lease: SandboxLease, app: Path, limits: Limits, env_mounts: list[Mount], env_vars: dict[str, str]
) -> tuple[list[dict], list[str], str | None]:
    """Run the sanitizer on the job copy `app` inside the sandbox: (tampering, restored, error)."""
    mounts = [Mount(app, "/app", True), *env_mounts]
    orig = tests = ""
    if task.app_dir.is_dir():
        mounts.append(Mount(task.app_dir, "/orig", False))
        orig = lease.path_in_sandbox(mounts[-1])
    if task.tests_dir.is_dir():
        mounts.append(Mount(task.tests_dir, "/tests", False))
        tests = lease.path_in_sandbox(mounts[-1])
    argv = ["python3", "-I", "-c", _SANITIZE_SOURCE, lease.path_in_sandbox(mounts[0]), orig, tests]
    argv.append(sanitize_scope(task))
    run_limits = limits.with_(wall_seconds=SANITIZE_TIMEOUT_S, cpu_seconds=int(SANITIZE_TIMEOUT_S))
    result = await lease.run(argv, mounts=mounts, cwd="/", limits=run_limits, env=env_vars)
    try:
        facts = json.loads(result.stdout.strip().splitlines()[-1]) if result.exit_code == 0 else None
    except (ValueError, IndexError):
        facts = None
    if not isinstance(facts, dict):
        tail = (result.stderr or result.stdout)[-500:].strip()
        why = "timed out" if result.timed_out else f"exit {result.exit_code}"
        return [], [], f"checking the workspace's test infrastructure failed ({why}): {tail}; the tests did not run"
    return list(facts.get("tampering", [])), list(facts.get("restored", [])), None


def tampering_error(tampering: list[dict]) -> str:
    """The grade's error for a workspace that tampered with grading (its reward is 0)."""
    shown = ", ".join(f"{t['path']} ({t['class']})" for t in tampering[:10])
    more = f" and {len(tampering) - 10} more" if len(tampering) > 10 else ""
    return f"the workspace tampered with grading: {shown}{more}; reward 0 (docs/env_protocol.md, What a grade trusts)"
