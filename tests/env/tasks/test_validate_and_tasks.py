"""`env validate`, the Harbor task loader's errors, and generated-task resolution."""

from __future__ import annotations

import shutil
import subprocess
import sys
import types

import pytest
from support.bwrap import needs_bwrap
from support.live_server import FIXTURE_TASKS, env_with_src

from composer_jax.env.api.errors import TaskError
from composer_jax.env.tasks.store import TaskStore, load_task, parse_task_config


def run_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "composer_jax.cli", *args],
        capture_output=True,
        text=True,
        env=env_with_src(),
        timeout=300,
    )


@pytest.mark.sandbox
@needs_bwrap
def test_validate_fixture_suite_passes():
    r = run_cli("env", "validate", str(FIXTURE_TASKS), "--jobs", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 pass, 0 fail, 0 invalid, 2 skipped (of 4)" in r.stdout
    assert "gpus = 1" in r.stdout and "Dockerfile" in r.stdout


@pytest.mark.sandbox
@needs_bwrap
def test_validate_catches_bad_tasks(tmp_path):
    shutil.copytree(FIXTURE_TASKS / "fix-add", tmp_path / "wrong-oracle")
    (tmp_path / "wrong-oracle" / "solution" / "solve.sh").write_text("#!/bin/bash\ntrue\n")
    shutil.copytree(FIXTURE_TASKS / "write-hello", tmp_path / "already-solved")
    (tmp_path / "already-solved" / "environment" / "app" / "hello.txt").write_text("hello, world\n")
    (tmp_path / "broken-toml").mkdir()
    (tmp_path / "broken-toml" / "task.toml").write_text("[verifier]\ntimeout_sec = 'soon'\n")
    r = run_cli("env", "validate", str(tmp_path))
    assert r.returncode == 1
    lines = {line.split()[0]: line for line in r.stdout.splitlines() if line.strip()}
    assert "reference solution scored 0, expected 1" in lines["wrong-oracle"]
    assert "untouched workspace scored 1, expected 0" in lines["already-solved"]
    assert "timeout_sec = 'soon' is not a number" in lines["broken-toml"]


def test_cli_argument_errors(tmp_path):
    r = run_cli("env", "frobnicate")
    assert r.returncode == 2 and "accepted: validate" in r.stderr
    r = run_cli("env", "validate", str(tmp_path / "missing"))
    assert r.returncode == 2 and "is not a directory" in r.stderr
    r = run_cli("env-server", "--tasks", str(FIXTURE_TASKS), "--port", "99999")
    assert r.returncode == 2 and "outside 0-65535" in r.stderr


@pytest.mark.parametrize(
    "toml,fragment",
    [
        ({"version": 1}, "version = 1 must be a string"),
        ({"verifier": {"timeout_sec": -5}}, "timeout_sec = -5 must be > 0"),
        ({"environment": {"gpus": "two"}}, "gpus = 'two' must be an integer >= 0"),
        ({"environment": {"memory": "lots"}}, "memory = 'lots' is not a size"),
        ({"environment": {"allow_internet": "yes"}}, "allow_internet = 'yes' must be true or false"),
        ({"metadata": {"tags": "python"}}, "tags = 'python' must be a list of strings"),
        ({"agent": []}, "[agent] must be a table"),
        ({"verifier": {"python_modules": "pytest"}}, "python_modules = 'pytest' must be a list of importable"),
        ({"verifier": {"python_modules": ["a b"]}}, "python_modules = ['a b'] must be a list of importable"),
    ],
)
def test_task_config_errors_name_the_field(toml, fragment):
    with pytest.raises(TaskError, match=None) as info:
        parse_task_config(toml, "t")
    assert fragment in str(info.value)


def test_task_config_sizes_and_defaults():
    cfg = parse_task_config({"environment": {"memory": "2G", "storage": "512M"}}, "t")
    assert (cfg.memory_mb, cfg.storage_mb, cfg.gpus, cfg.verifier_timeout_sec) == (2048, 512, 0, 120.0)
    assert parse_task_config({"environment": {"memory_mb": 300}}, "t").memory_mb == 300


def test_load_task_and_runnability(tmp_path):
    task = load_task(FIXTURE_TASKS / "fix-add")
    assert task.runnable and task.config.metadata["category"] == "debugging" and task.config.storage_mb == 64
    assert "Dockerfile" in load_task(FIXTURE_TASKS / "needs-docker").not_runnable_reason
    (tmp_path / "t").mkdir()
    with pytest.raises(TaskError, match="missing task.toml"):
        load_task(tmp_path / "t")
    (tmp_path / "t" / "task.toml").write_text("version = '1.0'\n")
    (tmp_path / "t" / "instruction.md").write_text("do it")
    with pytest.raises(TaskError, match="missing tests/test.sh"):
        load_task(tmp_path / "t")


def test_store_resolves_generated_families(tmp_path, monkeypatch):
    def generate_task(family, seed, dest):
        shutil.copytree(FIXTURE_TASKS / "write-hello", dest)
        (dest / "instruction.md").write_text(f"{family} seed {seed}\n")
        return dest

    fake = types.ModuleType("composer_jax.env.tasks.families")
    fake.FAMILIES, fake.generate_task = {"hello": None}, generate_task
    monkeypatch.setitem(sys.modules, "composer_jax.env.tasks.families", fake)
    store = TaskStore(FIXTURE_TASKS, tmp_path)
    assert store.get("gen/hello", 7).instruction == "hello seed 7\n"
    assert store.get("gen/hello").instruction == "hello seed 0\n"
    assert store.get("gen/hello", 7) is store.get("gen/hello", 7)  # generated once
    with pytest.raises(TaskError, match="unknown task family 'nope'.*accepted: hello"):
        store.get("gen/nope")
    with pytest.raises(TaskError, match="unknown task_id 'zzz'; known tasks: fix-add, gpu-task"):
        store.get("zzz")
    with pytest.raises(TaskError, match="seed -3 must be an integer"):
        store.get("fix-add", -3)
