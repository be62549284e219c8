"""The bundled tasks and the task-family generator are clean under Harbor's default lint rules.

Harbor's own linter runs where it is installed (it needs Python 3.12: `make harbor` builds
`.venv-harbor` when a python3.12 is found, or set HARBOR to a `harbor` executable); everywhere,
`tests/support/harbor_rules.py` checks the same default rules. docs/env_protocol.md says which `--select ALL`
findings remain and why; the Harbor test checks that list is exactly what the linter reports.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from support.harbor_rules import findings

from composer_jax.env.tasks.families import FAMILIES, generate_task
from composer_jax.env.tasks.families.base import DOCKERFILE, PYTEST_REQUIREMENT, TEST_SH, task_toml

ROOT = Path(__file__).resolve().parents[3]
TASKS = sorted(p for p in (ROOT / "tasks").iterdir() if (p / "task.toml").is_file())


def _harbor() -> str | None:
    for candidate in (os.environ.get("HARBOR"), ROOT / ".venv-harbor" / "bin" / "harbor", shutil.which("harbor")):
        if candidate and Path(candidate).is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> list[Path]:
    dest = tmp_path_factory.mktemp("families")
    return [generate_task(family, seed, dest) for family in sorted(FAMILIES) for seed in (0, 1)]


def test_bundled_tasks_follow_harbor_default_rules():
    assert len(TASKS) == 41
    assert {t.name: findings(t) for t in TASKS if findings(t)} == {}


def test_generated_tasks_follow_harbor_default_rules(generated):
    assert {t.name: findings(t) for t in generated if findings(t)} == {}


def test_rule_check_catches_what_harbor_reported(tmp_path):
    """The two findings Harbor reported on every task before (82 = 41 x 2) are caught here."""
    task = tmp_path / "t"
    (task / "environment").mkdir(parents=True)
    (task / "tests").mkdir()
    (task / "instruction.md").write_text("do it\n")
    (task / "tests" / "test.sh").write_text(TEST_SH + "pip install pytest\ncurl -o x https://example.com/x\n")
    (task / "environment" / "Dockerfile").write_text(
        DOCKERFILE.replace(PYTEST_REQUIREMENT, "pytest") + "COPY tests/test_x.py /app/\n"
    )
    toml = task_toml(difficulty="easy", category="bugfix", tags=["x"])
    (task / "task.toml").write_text(toml.replace('environment_mode = "separate"\n', "") + "colour = 1\n")
    assert sorted(f.split(":")[0] for f in findings(task)) == [
        "agent-image-test-leak",
        "shared-verifier",
        "unknown-config-field",
        "unpinned-python-dependency",
        "unpinned-python-dependency",
        "verifier-network-download",
        "verifier-runtime-install",
    ]


def test_image_pins_the_pytest_the_sandbox_runs():
    lock = (ROOT / "locks" / "base.lock").read_text()
    assert re.search(rf"^{re.escape(PYTEST_REQUIREMENT)}\b", lock, re.M), PYTEST_REQUIREMENT
    assert all((t / "environment" / "Dockerfile").read_text().count(PYTEST_REQUIREMENT) == 1 for t in TASKS)


@pytest.mark.skipif(_harbor() is None, reason="Harbor is not installed (needs Python 3.12; `make harbor`)")
def test_harbor_linter(generated):
    harbor = _harbor()
    assert harbor is not None
    dirs = [str(t) for t in TASKS + generated]
    proc = subprocess.run([harbor, "lint", *dirs], capture_output=True, text=True, timeout=300)
    assert (proc.returncode, proc.stdout.strip()) == (0, ""), proc.stdout[-3000:] + proc.stderr[-3000:]
    proc = subprocess.run([harbor, "lint", "--select", "ALL", "--json", *dirs], capture_output=True, text=True)
    remaining = {(f["rule"], Path(f["path"]).name) for f in json.loads(proc.stdout)}
    # What docs/env_protocol.md says remains under --select ALL: per task, the base image has no
    # digest and the agent user is unset.
    assert remaining == {("unpinned-image", "Dockerfile"), ("root-agent", "task.toml")}
    assert len(json.loads(proc.stdout)) == 2 * len(dirs)
