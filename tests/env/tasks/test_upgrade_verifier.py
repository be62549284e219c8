"""`composer-jax env upgrade-verifier`: task directories the project wrote before the per-test
verifier get it in place (a bundled task as it was at d968e98, a mined task with an older
run_tests.py); a verifier the project did not write is left alone; a second run changes nothing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from support.live_server import FIXTURE_TASKS
from support.repo_tasks import repo_task

from composer_jax.env.tasks import tampering
from composer_jax.env.tasks.families.base import TEST_SH, VERIFIER_SOURCE
from composer_jax.env.tasks.families.base import test_sh as render_test_sh
from composer_jax.env.tasks.store import load_task
from composer_jax.env.tasks.upgrade import upgrade_main

ROOT = Path(__file__).resolve().parents[3]
# tests/test.sh of every bundled task before issue 49: pytest's exit status was the reward
OLD_SUITE_SH = """\
#!/usr/bin/env bash
mkdir -p /logs/verifier
cd /app || { echo 0 > /logs/verifier/reward.txt; exit 0; }
export PYTHONPATH=/app
export PYTHONDONTWRITEBYTECODE=1
python3 -I -c 'import sys, pytest; sys.path.insert(0, "/app"); sys.exit(pytest.console_main())' \\
    -q -p no:cacheprovider --rootdir=/tests --junitxml=/logs/verifier/junit.xml /tests
rc=$?
chmod u+rwx /logs/verifier && rm -rf /logs/verifier/reward.txt
if [ $rc -eq 0 ]; then echo 1 > /logs/verifier/reward.txt; else echo 0 > /logs/verifier/reward.txt; fi
exit 0
"""


def test_old_tasks_get_the_per_test_verifier(tmp_path, capsys):
    tasks = tmp_path / "tasks"
    shutil.copytree(ROOT / "tasks" / "lru-recency-bug", tasks / "bundled")
    (tasks / "bundled" / "tests" / "run_tests.py").unlink()
    (tasks / "bundled" / "tests" / "test.sh").write_text(OLD_SUITE_SH)
    imported = repo_task(tmp_path, tasks, name="imported", instance_id="acme__calc-1", source="swebench")
    config = json.loads((imported / "tests" / "config.json").read_text())
    old = {k: v for k, v in config.items() if k not in ("rule", "own_modules")}
    (imported / "tests" / "config.json").write_text(json.dumps(old))
    (imported / "tests" / "run_tests.py").write_text("# the verifier before issue 49\n")
    shutil.copytree(FIXTURE_TASKS / "fix-add", tasks / "fix-add")
    assert not tampering.verdicts_expected(load_task(tasks / "bundled"))

    assert upgrade_main([str(tasks)]) == 0
    lines = {line.rsplit(maxsplit=1)[1]: line.rsplit(maxsplit=1)[0] for line in capsys.readouterr().out.splitlines()}
    assert lines[str(tasks / "bundled")] == "upgraded" and lines[str(imported)] == "upgraded"
    assert lines[str(tasks / "fix-add")].startswith("skipped")
    assert (tasks / "bundled" / "tests" / "test.sh").read_text() == TEST_SH
    assert (imported / "tests" / "run_tests.py").read_text() == VERIFIER_SOURCE
    assert (imported / "tests" / "test.sh").read_text() == render_test_sh(
        50
    )  # its own time limit kept (repo_task: 60 s)
    assert json.loads((imported / "tests" / "config.json").read_text())["rule"] == "swebench"
    assert all(tampering.verdicts_expected(load_task(tasks / t)) for t in ("bundled", "imported"))

    assert upgrade_main([str(tasks)]) == 0
    assert sorted(line.split()[0] for line in capsys.readouterr().out.splitlines()) == [
        "current",
        "current",
        "skipped:",
    ]
