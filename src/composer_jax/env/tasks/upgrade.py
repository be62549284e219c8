"""`composer-jax env upgrade-verifier DIR ...`: give task directories this project wrote before the
per-test verifier (tasks/verifier.py) the current one, in place.

A suite task (bundled or generated: its test.sh ran pytest on /tests itself and paid on the exit
status) gets tests/test.sh + tests/run_tests.py; a repository task (mined or imported: tests/config.json
and a tests/run_tests.py) gets the current run_tests.py, its test.sh keeps its time limit, and its
config.json gains the status rule (SWE-bench's for an imported instance) and `own_modules`.
A task whose verifier this project did not write is left alone and named. Until upgraded, such a
task is graded from its reward.txt (grader.py), without per-test verdicts.
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

from composer_jax.env.tasks import verifier
from composer_jax.env.tasks.families.base import VERIFIER_SOURCE, test_sh, write_verifier

# What the project's old suite verifier said (families/base.py TEST_SH before issue 49).
_OLD_SUITE = ("pytest.console_main()", "--rootdir=/tests", "/logs/verifier/reward.txt")


def task_dirs(root: Path) -> list[Path]:
    """`root` itself when it is a task directory (has tests/test.sh), else its task subdirectories."""
    if (root / "tests" / "test.sh").is_file():
        return [root]
    return sorted(p for p in root.iterdir() if (p / "tests" / "test.sh").is_file()) if root.is_dir() else []


def upgrade_task(task: Path) -> str:
    """Upgrade one task directory in place: "upgraded", "current" or "skipped: why"."""
    tests = task / "tests"
    script = (tests / "test.sh").read_text(errors="replace")
    config_path = tests / "config.json"
    if config_path.is_file() and (tests / "run_tests.py").is_file() and "run_tests.py" in script:
        limit = re.search(r"--timeout (\d+(?:\.\d+)?)", script)
        timeout = float(limit.group(1)) if limit else None
        config = json.loads(config_path.read_text())
        try:
            meta = tomllib.loads((task / "task.toml").read_text()).get("metadata", {})
        except (OSError, tomllib.TOMLDecodeError):
            meta = {}
        wanted = {
            "rule": config.get("rule", "swebench" if meta.get("source") == "swebench" else "passed"),
            "own_modules": config.get("own_modules", verifier.own_modules(task / "environment" / "app")),
        }
        current = (tests / "run_tests.py").read_text() == VERIFIER_SOURCE and script == test_sh(timeout)
        if current and all(k in config for k in wanted):
            return "current"
        config_path.write_text(json.dumps({**config, **wanted}, indent=1))
        write_verifier(tests, timeout)
        return "upgraded"
    if all(marker in script for marker in _OLD_SUITE) and not config_path.exists():
        write_verifier(tests)
        return "upgraded"
    if script == test_sh() and (tests / "run_tests.py").is_file():
        if (tests / "run_tests.py").read_text() == VERIFIER_SOURCE:
            return "current"
        write_verifier(tests)
        return "upgraded"
    return "skipped: its tests/test.sh is not a verifier this project writes"


def upgrade_main(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(
        prog="composer-jax env upgrade-verifier",
        description="Give task directories this project wrote (bundled, generated, mined, imported) the "
        "current verifier (per-test verdicts), in place; one line per task.",
    )
    p.add_argument("dirs", type=Path, nargs="+", help="task directories, or directories of them")
    args = p.parse_args(argv)
    found = 0
    for root in args.dirs:
        for task in task_dirs(root):
            found += 1
            print(f"{upgrade_task(task):<10} {task}")
    if not found:
        print(f"composer-jax env upgrade-verifier: no task directories under {' '.join(map(str, args.dirs))}")
        return 1
    return 0
