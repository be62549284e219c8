"""The learner with its samplers in other processes: `rl.local_samplers` `composer-jax serve`
replicas started by the run, following the run's weight store, told to load each new version
before its groups start. One replica is killed mid-run: its rollouts are redone on the other and
the run completes, every group id trained once, every trained token sampled by the weights it
trains (max_staleness 0), and the store holds every version bit-exactly as the checkpoint."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from support.bwrap import needs_bwrap
from support.live_env import REPO

from composer_jax.checkpoint.manager import restore_params_only
from composer_jax.config import ConfigError, load_config
from composer_jax.model.lora import abstract_adapters
from composer_jax.model.params import abstract_params
from composer_jax.rl.learner import check_config, run_rl
from composer_jax.sharding import ShardingRules, make_mesh
from composer_jax.train.loop import run_checkpoint_config
from composer_jax.weightsync.subscriber import WeightSubscriber

CONFIG = REPO / "tests" / "rl" / "fixtures" / "rl_pick.yaml"
pytestmark = needs_bwrap


def _replicas(out: Path) -> list[int]:
    """pids of the serve replicas started for this run (their command line names its checkpoints)."""
    want = str(out / "checkpoints")
    pids = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            cmd = (Path("/proc") / d / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"serve" in cmd and want.encode() in cmd:
            pids.append(int(d))
    return sorted(pids)


# slow: 39 s; a killed child restarted is also tested by tests/runtime/test_supervisor.py and
# tests/rl/test_learner_supervision.py
@pytest.mark.slow
def test_two_replicas_one_killed_mid_run(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    out = tmp_path / "run"
    cfg = load_config(
        CONFIG,
        [f"train.out_dir={out}", "train.steps=3", "rl.eval_tasks=[]", "rl.local_samplers=2", "rl.sampler.slots=4"],
    )
    killed: list[int] = []

    def kill_after_first_step() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            m = out / "metrics.jsonl"
            if m.exists() and '"step": 1' in m.read_text():
                pids = _replicas(out)
                if pids:
                    os.kill(pids[0], signal.SIGKILL)
                    killed.append(pids[0])
                return
            time.sleep(0.05)

    watcher = threading.Thread(target=kill_after_first_step, daemon=True)
    watcher.start()
    summary = run_rl(cfg, echo=lambda _: None)
    watcher.join(5)
    assert killed, "the watcher found no replica to kill"
    assert summary["final_step"] == 3 and not summary["lost_groups"] and not summary["dropped_stale_groups"]
    trained = [i for ids in summary["trained_groups"].values() for i in ids]
    assert sorted(trained) == list(range(6))  # 3 steps x 2 groups, each id once
    for n, v in summary["steps"].items():
        # sampled by the version trained: the replicas loaded it before the step's groups started
        assert v["version_lag_max"] == 0 and v["staleness/max"] == 0, (n, v)
        assert abs(v["mismatch_kl_k1"]) < 1e-4  # another process, the same weights
    assert not _replicas(out)  # the survivor went with the run
    # the store the replicas followed: version 3 is the final checkpoint's weights, bit for bit
    sub = WeightSubscriber(f"file://{out}/weight_store")
    assert sub.latest_version() == 3
    mesh = make_mesh(cfg.mesh)
    params = restore_params_only(
        run_checkpoint_config(cfg).directory,
        abstract_params(cfg.model, mesh, ShardingRules.create(cfg.sharding_rules)),
        3,
    )
    got, published = sub.read(3)
    assert got == 3
    flat = jax.tree.leaves(jax.device_get(params))
    assert len(jax.tree.leaves(published)) == len(flat)
    for a, b in zip(jax.tree.leaves(published), flat, strict=True):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))


# slow: 40-70 s (a run with a serve replica); the default suite keeps the replica's merge in
# tests/inference/server/test_serve_lora.py's config check and tests/rl/test_learner_lora.py's
# publish of the adapters
@pytest.mark.slow
def test_lora_run_with_a_serve_replica(tmp_path, monkeypatch) -> None:
    """train.lora with one `composer-jax serve` replica: the replica starts on the run's checkpoint
    (the adapters, merged into the base it loads from train.seed) and merges each published version
    (the adapters' bytes) into that base: every token is sampled by the weights trained on it
    (mismatch KL ~ 0, a process that merged for itself), and the store holds the adapters alone."""
    monkeypatch.chdir(REPO)
    out = tmp_path / "run"
    lora = ["train.lora.rank=4", "train.lora.alpha=8", "train.lora.targets=[attention]"]
    cfg = load_config(
        CONFIG,
        [
            f"train.out_dir={out}",
            "train.steps=2",
            "rl.eval_tasks=[]",
            "rl.local_samplers=1",
            "rl.sampler.slots=4",
            *lora,
        ],
    )
    summary = run_rl(cfg, echo=lambda _: None)
    assert summary["final_step"] == 2 and not summary["lost_groups"] and not summary["dropped_stale_groups"]
    for n, v in summary["steps"].items():
        assert v["version_lag_max"] == 0 and abs(v["mismatch_kl_k1"]) < 1e-4, (n, v)
    mesh = make_mesh(cfg.mesh)
    adapters = restore_params_only(
        run_checkpoint_config(cfg).directory,
        abstract_adapters(cfg.model, cfg.train.lora, mesh, ShardingRules.create(cfg.sharding_rules)),
        2,
    )
    got, published = WeightSubscriber(f"file://{out}/weight_store").read(2)
    assert got == 2 and str(jax.tree.structure(published)) == str(jax.tree.structure(jax.device_get(adapters)))
    for a, b in zip(jax.tree.leaves(published), jax.tree.leaves(jax.device_get(adapters)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_process_config_errors(monkeypatch):
    monkeypatch.chdir(REPO)
    with pytest.raises(ConfigError, match="nothing to pin apart"):
        check_config(load_config(CONFIG, ["rl.pin_cores=true"]))
    many = len(os.sched_getaffinity(0)) + 1
    with pytest.raises(ConfigError, match=f"needs {many + 1} cores"):
        check_config(load_config(CONFIG, ["rl.pin_cores=true", f"rl.local_samplers={many}"]))
    with pytest.raises(ConfigError, match=r"rl.env_cores='trainer' is not accepted; accepted: 'samplers' or 'all'"):
        load_config(CONFIG, ["rl.env_cores=trainer"])
    with pytest.raises(ConfigError, match="rl.sampler_urls needs rl.weight_store"):
        load_config(CONFIG, ["rl.sampler_urls=[http://127.0.0.1:1]"])
    with pytest.raises(ConfigError, match="not both"):
        load_config(CONFIG, ["rl.sampler_urls=[http://h:1]", "rl.weight_store=file:///x", "rl.local_samplers=1"])


def test_multi_process_trainer_config_errors(monkeypatch):
    """A trainer of several JAX processes samples through replicas and pins nothing."""
    monkeypatch.setattr(jax, "process_count", lambda: 2)
    with pytest.raises(ConfigError, match=r"rl.sampler_urls .* or rl.local_samplers >= 1"):
        check_config(load_config(CONFIG, []))
    with pytest.raises(ConfigError, match=r"rl.pin_cores=true .* 2 processes: accepted rl.pin_cores=false"):
        check_config(load_config(CONFIG, ["rl.local_samplers=1", "rl.pin_cores=true"]))
    check_config(load_config(CONFIG, ["rl.local_samplers=1"]))
    check_config(load_config(CONFIG, ["rl.sampler_urls=[http://h:1]", "rl.weight_store=file:///x"]))
