"""The learner's children are supervised: its only local environment server, SIGKILLed mid-run, is
restarted and the run completes without spending group ids on the outage; a SIGKILLed trainer
leaves no child process behind (environment servers, their sandboxes, sampler replicas)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
from support.bwrap import needs_bwrap
from support.live_env import REPO
from support.procs import cmdline, descendants, gone

from composer_jax.config import load_config
from composer_jax.rl import learner as trainer

CONFIG = REPO / "tests" / "rl" / "fixtures" / "rl_pick.yaml"
pytestmark = needs_bwrap


def env_server_pids() -> list[int]:
    return sorted(p for p in descendants(os.getpid()) if "env-server" in cmdline(p))


def test_the_only_environment_server_killed_mid_run_is_restarted_and_no_group_id_is_spent(
    tmp_path, monkeypatch
) -> None:
    monkeypatch.chdir(REPO)
    out = tmp_path / "run"
    cfg = load_config(CONFIG, [f"train.out_dir={out}", "train.steps=3", "rl.eval_tasks=[]", "rl.env_wait_s=120"])
    started: set[int] = set()
    finished: set[int] = set()
    in_flight_at_kill: set[int] = set()
    killed: list[int] = []
    sample_group = trainer.sample_group

    async def recorded(pool, client, cfg, index):
        started.add(index)
        try:
            return await sample_group(pool, client, cfg, index)
        finally:
            finished.add(index)

    def kill_after_first_step() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            m = out / "metrics.jsonl"
            if m.exists() and '"step": 1' in m.read_text():
                [pid] = env_server_pids()
                in_flight_at_kill.update(started - finished)
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
                return
            time.sleep(0.02)

    monkeypatch.setattr(trainer, "sample_group", recorded)
    watcher = threading.Thread(target=kill_after_first_step, daemon=True)
    watcher.start()
    summary = trainer.run_rl(cfg, echo=lambda _: None)
    watcher.join(5)
    assert killed, "the watcher found no environment server to kill"
    assert summary["final_step"] == 3
    trained = [i for ids in summary["trained_groups"].values() for i in ids]
    assert len(trained) == 6 and len(set(trained)) == 6  # 3 steps x 2 groups, each id once
    # the only ids finished untrained are groups that were in flight when the server died
    untrained = summary["lost_groups"] + summary["dropped_stale_groups"]
    assert set(untrained) <= in_flight_at_kill, (untrained, in_flight_at_kill)
    assert sorted(trained + untrained) == list(range(6 + len(untrained)))  # no id skipped
    last = summary["steps"][3]
    assert last["env_servers/restarts"] == 1.0 and last["env_servers/alive"] == 1.0
    log = (out / "env_servers" / "env-server-0.log").read_text()
    assert log.count('"event": "ready"') == 2  # the first start and the restart


@pytest.mark.slow
def test_a_sigkilled_trainer_leaves_no_child_process(tmp_path) -> None:
    out = tmp_path / "run"
    argv = [sys.executable, "-m", "composer_jax.cli", "rl", "--config", str(CONFIG), f"train.out_dir={out}"]
    argv += ["train.steps=50", "rl.eval_tasks=[]", "rl.local_samplers=1", "rl.sampler.slots=4"]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline and proc.poll() is None:
            m = out / "metrics.jsonl"
            if m.exists() and '"step": 1' in m.read_text():
                break
            time.sleep(0.1)
        assert proc.poll() is None, f"the trainer exited with {proc.returncode} before its first step"
        children = set(descendants(proc.pid))
        kinds = {
            "env-server" if "env-server" in cmdline(p) else "serve" if "serve" in cmdline(p) else "" for p in children
        }
        assert {"env-server", "serve"} <= kinds, [cmdline(p) for p in children]
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        deadline = time.monotonic() + 30
        left = children
        while left and time.monotonic() < deadline:
            left = {p for p in children if not gone(p)}
            time.sleep(0.2)
        assert not left, [cmdline(p) for p in left]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
