"""rl/launch.py: a `composer-jax serve` replica as a child process, pinned to a core, following a
weight-sync store, driven through RemoteTokenPolicy; teardown (also on an exception) leaves no process."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import httpx
import jax
import numpy as np
import pytest
from support.live_env import REPO
from support.procs import children, gone

from composer_jax.checkpoint.manager import TrainCheckpointer
from composer_jax.config import load_config, to_dict
from composer_jax.config.checkpoint import CheckpointConfig
from composer_jax.config.sampler import SamplerConfig
from composer_jax.formats.tokenizer import load_tokenizer
from composer_jax.inference.server.policy import load_policy
from composer_jax.rl.samplers.policy import SamplerUnavailable, TurnRequest
from composer_jax.rl.samplers.serve import RemoteTokenPolicy
from composer_jax.rl.samplers.serve_launch import LocalSamplers, SamplerLaunchError
from composer_jax.sharding import ShardingRules, make_mesh
from composer_jax.train.state import init_train_state
from composer_jax.weightsync.publisher import WeightPublisher

TOK = load_tokenizer(REPO / "assets" / "tokenizer")
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory = tmp_path_factory.mktemp("launch_ckpt")
    cfg = load_config(
        "configs/model/tiny.yaml",
        [
            f"model.vocab_size={TOK.vocab_size}",
            "model.num_layers=2",
            "model.max_position_embeddings=256",
            "mesh.fsdp=1",
            "data.tokenizer=assets/tokenizer",
        ],
        num_devices=None,
    )
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    state = init_train_state(cfg, mesh, ShardingRules.create(cfg.sharding_rules))
    with TrainCheckpointer(CheckpointConfig(directory=str(directory), save_every=1)) as ck:
        ck.save(1, state, config=to_dict(cfg))
    return directory


def _turn(url: str, key: str) -> list[int]:
    async def go():
        policy = RemoteTokenPolicy(url, key, TOK, max_context=256)
        gen = policy.begin(MESSAGES)
        try:
            await policy.turn(gen, TurnRequest(max_tokens=3, seed=1))
        finally:
            await policy.aclose()
        return [v for v in gen.versions if v >= 0]

    return asyncio.run(go())


def test_one_replica_serves_follows_the_store_and_leaves_nothing(checkpoint, tmp_path):
    url = f"file://{tmp_path}/weights"
    core = min(os.sched_getaffinity(0))
    samplers = LocalSamplers(
        checkpoint, 1, weights_from=url, sampler=SamplerConfig(poll_s=0.1), cores=[core], log_dir=tmp_path
    )
    with pytest.raises(RuntimeError, match="the learner's own failure"):
        with samplers as (urls, key):
            (proc,) = samplers.procs
            assert os.sched_getaffinity(proc.pid) == {core}
            health = httpx.get(urls[0] + "/health").json()
            assert health["policy_version"] == 0 and health["weights_from"] == url
            assert _turn(urls[0], key) == [0, 0, 0]
            params = jax.tree.map(np.asarray, jax.device_get(load_policy(checkpoint).params))
            WeightPublisher(url).publish(params, 4)
            for _ in range(600):
                if httpx.get(urls[0] + "/health").json()["policy_version"] == 4:
                    break
                time.sleep(0.05)
            assert _turn(urls[0], key) == [4, 4, 4]
            os.kill(proc.pid, signal.SIGKILL)  # a sampler dies: the rollout on it is to be redone elsewhere
            proc.wait(10)
            with pytest.raises(SamplerUnavailable, match="ConnectError"):
                _turn(urls[0], key)
            raise RuntimeError("the learner's own failure")
    assert samplers.procs == [] and gone(proc.pid)
    assert "composer-jax serve:" in (tmp_path / "sampler-0.log").read_text()


def test_failed_start_is_reported_and_cleaned_up(checkpoint, tmp_path):
    samplers = LocalSamplers(checkpoint, 1, extra_args=("--slots", "0"), log_dir=tmp_path)
    with pytest.raises(
        SamplerLaunchError, match=r"(?s)sampler replica 0 .* exited with status 2.*--slots: 0 must be >= 1"
    ):
        with samplers:
            pass
    assert samplers.procs == []
    with pytest.raises(SamplerLaunchError, match=r"cores=\[-1\]: give 1 distinct cores"):
        LocalSamplers(checkpoint, 1, cores=[-1])
    with pytest.raises(SamplerLaunchError, match="count=0"):
        LocalSamplers(checkpoint, 0)
    with pytest.raises(SamplerLaunchError, match="does not exist"):
        LocalSamplers(tmp_path / "nope", 1)


def test_slow_start_names_the_timeout_and_is_cleaned_up(checkpoint, tmp_path):
    # no replica imports JAX and reads a checkpoint in 0.5 s: the error names the limit to raise
    samplers = LocalSamplers(checkpoint, 1, log_dir=tmp_path, start_timeout_s=0.5)
    with pytest.raises(SamplerLaunchError, match=r"sampler replica 0 .* within start_timeout_s=0.5 s"):
        with samplers:
            pass
    assert samplers.procs == []


LAUNCHER = """
import sys, time
from composer_jax.rl.samplers.serve_launch import LocalSamplers
with LocalSamplers(sys.argv[1], 1, log_dir=sys.argv[2]):
    time.sleep(600)
"""


def test_replicas_die_with_a_killed_launcher(checkpoint, tmp_path):
    # the launcher is SIGKILLed (no teardown runs) while its replica is still starting
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, str(checkpoint), str(tmp_path)])
    try:
        for _ in range(600):
            kids = children(launcher.pid)
            if kids:
                break
            time.sleep(0.05)
        assert kids, "the launcher started no replica"
        time.sleep(1.0)
    finally:
        launcher.kill()
        launcher.wait(10)
    for _ in range(600):
        if all(gone(k) for k in kids):
            break
        time.sleep(0.05)
    assert all(gone(k) for k in kids)
