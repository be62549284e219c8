"""`serve --weights-from`: a live server follows an RL weight-sync store (inference/store_weights.py,
server.py), and `/admin/load_weights` with `"source": "weight_store"`.

A publisher in the test writes versions; the server picks them up by polling and serves them under
the published numbers. The swapped-in weights are checked against an in-process Sampler built on the
published parameters (an independent path: no server, no store).
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import jax
import numpy as np
import pytest
from support.metrics_scrape import scrape
from support.serve_thread import app_in_thread, stop_app

from composer_jax.checkpoint.manager import TrainCheckpointer
from composer_jax.cli import main as cli_main
from composer_jax.config import load_config, to_dict
from composer_jax.config.checkpoint import CheckpointConfig
from composer_jax.config.sampler import SamplerConfig
from composer_jax.formats.tokenizer import load_tokenizer
from composer_jax.inference.engine.batch_sampler import Request, Sampler, SamplerSettings
from composer_jax.inference.engine.token_sampling import SamplingParams
from composer_jax.inference.server.cli import build_server
from composer_jax.inference.server.policy import load_policy
from composer_jax.sharding import ShardingRules, make_mesh
from composer_jax.train.state import init_train_state
from composer_jax.weightsync.publisher import WeightPublisher

KEY = "store-test-key-0123456789"
MAX_LEN = 256


def _save(directory, seed: int) -> None:
    cfg = load_config(
        "configs/model/tiny.yaml",
        [
            "model.vocab_size=2048",
            "model.num_layers=2",
            f"model.max_position_embeddings={MAX_LEN}",
            "mesh.fsdp=1",
            "data.tokenizer=assets/tokenizer",
            f"train.seed={seed}",
        ],
        num_devices=None,
    )
    mesh = make_mesh(cfg.mesh, jax.devices()[:1])
    state = init_train_state(cfg, mesh, ShardingRules.create(cfg.sharding_rules))
    with TrainCheckpointer(CheckpointConfig(directory=str(directory), save_every=1)) as ck:
        ck.save(1, state, config=to_dict(cfg))


def _numpy(tree):
    return jax.tree.map(np.asarray, jax.device_get(tree))


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    a, b = tmp_path_factory.mktemp("store_ckpt_a"), tmp_path_factory.mktemp("store_ckpt_b")
    _save(a, 0)
    _save(b, 1)
    store = tmp_path_factory.mktemp("store")
    url = f"file://{store}/followed"
    pa, pb = load_policy(a), load_policy(b)
    tok = load_tokenizer(pa.tokenizer_hint)
    server, engine = build_server(
        pa,
        tok,
        sampler=SamplerConfig(slots=2, max_queued=2, poll_s=0.05),
        max_len=MAX_LEN,
        api_key=KEY,
        model_name="tiny",
        weights_from=url,
    )
    base, http, thread = app_in_thread(server.app)
    yield {
        "base": base,
        "url": url,
        "server": server,
        "engine": engine,
        "a": pa,
        "b": pb,
        "store": store,
        "publisher": WeightPublisher(url),
    }
    stop_app(http, thread)
    engine.stop()


def _post(live, path: str, body: dict) -> httpx.Response:
    headers = {"Authorization": f"Bearer {KEY}"}
    return httpx.post(live["base"] + path, content=json.dumps(body), headers=headers, timeout=120)


def _wait_version(live, version: int) -> dict:
    for _ in range(600):
        h = httpx.get(live["base"] + "/health").json()
        if h["policy_version"] == version:
            return h
        time.sleep(0.05)
    raise AssertionError(f"the server never served version {version}: {h}")


def _greedy_reference(params, cfg, prompt: list[int], n: int) -> list[int]:
    s = Sampler(params, cfg, SamplerSettings(slots=1, max_len=MAX_LEN))
    return s.run([Request(prompt, SamplingParams(temperature=0.0, max_tokens=n))])[0].tokens


def test_server_follows_the_store_and_a_request_spans_a_swap(live):
    engine, server, pub = live["engine"], live["server"], live["publisher"]
    assert engine.version == 0
    pub.publish(_numpy(live["b"].params), 1)
    h = _wait_version(live, 1)
    assert h["weights_from"] == live["url"] and h["store_error"] is None
    prompt = [5, 6, 7, 8]
    r = _post(live, "/v1/completions", {"prompt": prompt, "max_tokens": 12, "temperature": 0})
    choice = r.json()["choices"][0]
    assert choice["token_versions"] == [1] * 12
    assert choice["token_ids"] == _greedy_reference(live["b"].params, live["b"].cfg, prompt, 12)

    # A request spanning a swap: its listener (on the engine thread, between two steps) publishes
    # version 2 after the 5th token and holds the engine until the server has handed the new version
    # to it, so the swap lands before token 6.
    events, done = [], threading.Event()

    def listen(ev):
        events.append(ev)
        if ev.completion is None and sum(len(e.tokens) for e in events) == 5:
            pub.publish(_numpy(live["a"].params), 2)
            for _ in range(1200):
                if server.queued_version == 2:
                    break
                time.sleep(0.05)
        if ev.completion is not None or ev.error is not None:
            done.set()

    engine.submit([Request(prompt, SamplingParams(temperature=0.0, max_tokens=20), id="span")], listen, stream=True)
    assert done.wait(120)
    final = events[-1].completion
    assert final is not None and final.versions == [1] * 5 + [2] * 15
    assert final.tokens[:5] == _greedy_reference(live["b"].params, live["b"].cfg, prompt, 5)
    _wait_version(live, 2)
    r = _post(live, "/v1/completions", {"prompt": prompt, "max_tokens": 6, "temperature": 0})
    assert r.json()["choices"][0]["token_versions"] == [2] * 6
    assert r.json()["choices"][0]["token_ids"] == _greedy_reference(live["a"].params, live["a"].cfg, prompt, 6)
    # /metrics: the published numbers, one update per version the poller swapped in
    metrics = scrape(httpx.Client(base_url=live["base"], headers={"Authorization": f"Bearer {KEY}"}))
    assert metrics("cj_serve_weight_version") == 2 and metrics("cj_serve_weight_updates_total") == 2


def test_admin_load_weights_from_a_store(live, tmp_path):
    current = live["engine"].version
    url = f"file://{tmp_path}/other"
    pub = WeightPublisher(url)
    pub.publish(_numpy(live["b"].params), current + 10)
    r = _post(live, "/admin/load_weights", {"source": "weight_store", "url": url})
    assert r.status_code == 200, r.text
    assert r.json()["version"] == current + 10 and r.json()["previous_version"] == current
    assert r.json()["fallback"] is None
    assert httpx.get(live["base"] + "/health").json()["policy_version"] == current + 10
    again = _post(live, "/admin/load_weights", {"source": "weight_store", "url": url})
    assert again.status_code == 409 and "not newer than the served version" in again.json()["error"]["message"]
    # a version at or below the served one (the replica polled it, or a newer one, first): 409, not an error
    for v in (current + 10, current):
        older = _post(live, "/admin/load_weights", {"source": "weight_store", "url": url, "version": v})
        assert older.status_code == 409 and older.json()["error"]["code"] == "not_newer", older.text
    missing = _post(live, "/admin/load_weights", {"source": "weight_store", "url": url, "version": current + 50})
    assert missing.status_code == 400 and f"version {current + 50} is not in" in missing.json()["error"]["message"]
    bad = _post(live, "/admin/load_weights", {"source": "weight_store", "url": "not a url"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "url"
    # a corrupted newest version: the server reads the one before, which is not newer -> 409 naming it
    pub.publish(_numpy(live["a"].params), current + 11)
    for f in (tmp_path / "other" / "versions" / f"{current + 11:08d}" / "leaves").rglob("*"):
        if f.is_file() and f.name != "zarr.json":
            f.write_bytes(b"garbage")
    r = _post(live, "/admin/load_weights", {"source": "weight_store", "url": url})
    assert r.status_code == 409 and f"read version {current + 10} instead" in r.json()["error"]["message"]
    pub.publish(_numpy(live["a"].params), current + 12)
    r = _post(live, "/admin/load_weights", {"source": "weight_store", "url": url, "version": current + 12})
    assert r.status_code == 200 and r.json()["version"] == current + 12
    # a store of another model's tree is refused naming the leaf
    pub2 = WeightPublisher(f"file://{tmp_path}/wrong")
    pub2.publish({"w": np.zeros((3,), np.float32)}, current + 20)
    r = _post(live, "/admin/load_weights", {"source": "weight_store", "url": f"file://{tmp_path}/wrong"})
    assert r.status_code == 400 and "not the served model's parameter tree" in r.json()["error"]["message"]


def test_serve_cli_refuses_bad_store_settings(live, capsys):
    ckpt = str(live["a"].path)
    assert cli_main(["serve", "--checkpoint", ckpt, "--weights-from", "file:///x", "--poll-interval", "0"]) == 2
    assert "--poll-interval 0.0 must be > 0" in capsys.readouterr().err
    assert cli_main(["serve", "--checkpoint", ckpt, "--weights-from", "nowhere", "--port", "0"]) == 2
    assert "weights_from: weight-sync url 'nowhere' is not a kvstore URL" in capsys.readouterr().err
