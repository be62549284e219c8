"""`composer-jax serve` on a `train.lora` RL run (inference/server/policy.py, app.py): the run's
checkpoint holds adapters, so the replica loads the run's frozen base (train.seed here), serves
the merged model and keeps the base; each version the run publishes (the adapters' bytes) merges
into that base again. The RL config's check lets LoRA run with serve replicas, not vLLM's."""

from __future__ import annotations

import time

import httpx
import jax
import numpy as np
import pytest
from support.live_env import REPO
from support.lora_run import lora_config, save_lora_run
from support.serve_thread import app_in_thread, stop_app

from composer_jax.config import ConfigError, check_rl_run
from composer_jax.config.sampler import SamplerConfig
from composer_jax.formats.tokenizer import load_tokenizer
from composer_jax.inference.server.cli import build_server
from composer_jax.inference.server.policy import load_policy
from composer_jax.model import lora
from composer_jax.weightsync.publisher import WeightPublisher

KEY = "lora-serve-key-0123456789"


def _close(a, b, tol: float = 1e-6) -> None:
    fa, fb = jax.tree.leaves(jax.device_get(a)), jax.tree.leaves(jax.device_get(b))
    assert str(jax.tree.structure(a)) == str(jax.tree.structure(b))
    for x, y in zip(fa, fb):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=tol)


def test_lora_runs_accept_serve_replicas_not_vllm(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    for engine in ("serve", "vllm"):
        cfg = lora_config(tmp_path, ["rl.local_samplers=1", f"rl.sampler_engine={engine}"])
        if engine == "serve":
            check_rl_run(cfg, process_count=1, cores=range(16))
        else:
            with pytest.raises(ConfigError, match="rl.sampler_engine='vllm'.*accepted: rl.sampler_engine=serve"):
                check_rl_run(cfg, process_count=1, cores=range(16))


# slow: 15-25 s (a LoRA run's state saved, the server's sampler compiled); the default suite keeps
# the config check above, and tests/hf/test_lora_convert.py's default test the checkpoint's reading
@pytest.mark.slow
def test_serve_merges_each_published_adapter_version_into_the_kept_base(tmp_path, monkeypatch) -> None:
    """The replica serves W + scale A B of the checkpoint's adapters over the base of train.seed;
    version 1 in the store (new adapters) is served as W + scale A1 B1 over the same base."""
    monkeypatch.chdir(REPO)
    cfg, state = save_lora_run(tmp_path / "run", step=2)
    scale = cfg.train.lora.scale
    policy = load_policy(tmp_path / "run")
    assert policy.lora is not None and policy.step == 2 and policy.tokenizer_hint is not None
    _close(policy.lora.base, state.frozen, 0.0)  # the fresh model of train.seed, made again on one device
    _close(policy.params, lora.merged(state.frozen, state.params, scale))

    url = f"file://{tmp_path / 'store'}"
    server, engine = build_server(
        policy,
        load_tokenizer(policy.tokenizer_hint),
        sampler=SamplerConfig(slots=2, max_queued=2, poll_s=0.05),
        max_len=128,
        api_key=KEY,
        model_name="tiny-lora",
        version=2,
        weights_from=url,
    )
    base_url, http, thread = app_in_thread(server.app)
    try:
        adapters = jax.tree.map(lambda x: np.asarray(x) * 1.5 + 0.01, jax.device_get(state.params))
        WeightPublisher(url).publish(adapters, 3)  # what the learner publishes: the adapters alone
        for _ in range(600):
            health = httpx.get(base_url + "/health").json()
            if health["policy_version"] == 3 or health["store_error"]:
                break
            time.sleep(0.05)
        assert health["policy_version"] == 3, health
        _close(engine.sampler.params, lora.merged(state.frozen, adapters, scale))
        r = httpx.post(
            base_url + "/v1/completions",
            json={"prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0},
            headers={"Authorization": f"Bearer {KEY}"},
            timeout=120,
        )
        assert r.json()["choices"][0]["token_versions"] == [3] * 4
    finally:
        stop_app(http, thread)
        engine.stop()
