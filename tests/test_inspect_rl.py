"""`composer-jax inspect` on RL configs: the Kimi K2 run's trainer step and vLLM replica against
hand calculations from the model's shapes (eval_shape only: nothing is allocated)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from composer_jax.cli import main as cli_main
from composer_jax.config import check_rl_run, load_config
from composer_jax.inspection import main

ROOT = Path(__file__).resolve().parents[1]
K2_RL = ROOT / "configs" / "rl" / "kimi_k2_h200.yaml"
TINY_RL = ROOT / "configs" / "rl" / "tiny_families.yaml"

# Kimi K2 (configs/model/kimi_k2.yaml): hidden 7168, vocab 163840, 61 layers (1 dense + 60 MoE),
# 64 heads, MLA q_lora 1536 / kv_lora 512 / nope 128 / rope 64 / v 128, 384 experts of width 2048
# + 1 shared, dense width 18432
D, V, L, H, QL, KVL, NOPE, ROPE, VH, E, F, FD = 7168, 163840, 61, 64, 1536, 512, 128, 64, 128, 384, 2048, 18432
ATTN = D * QL + QL + QL * H * (NOPE + ROPE) + D * (KVL + ROPE) + KVL + KVL * H * (NOPE + VH) + H * VH * D
ROUTED = 60 * E * 3 * D * F
K2_PARAMS = 2 * V * D + D + L * (ATTN + 2 * D) + 3 * D * FD + 60 * (E * 3 * D * F + 3 * D * F + D * E + E)


def _json(capsys, *argv: str) -> tuple[int, dict]:
    rc = main([*argv, "--json"])
    return rc, json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def k2():
    """The K2 RL config's report (one eval_shape of the 1T model)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main([str(K2_RL), "--json"])
    return rc, json.loads(out.getvalue())


def test_k2_parameters_and_serving_weights_by_hand(k2):
    _, r = k2
    assert r["params"]["total"] == K2_PARAMS == 1_026_408_232_448  # "1.04T" in Moonshot's rounding
    fp8, bf16 = r["rl"]["replicas"]  # the config's own precision first (rl.vllm.quantization: fp8)
    assert fp8["precision"] == "fp8" and bf16["precision"] == "bfloat16" and bf16["weights"] == 2 * K2_PARAMS
    # fp8: each routed expert matrix [7168, 2048] in 1 byte per weight + a float32 per 128 x 128
    # block (56 x 16 blocks)
    assert fp8["routed_experts"] == ROUTED + 4 * 60 * E * 3 * (D // 128) * (F // 128)
    # the rest: attention, shared and dense MLP matrices at 1 byte + block scales; embedding, head,
    # norms and router at 2 bytes
    assert 14.0e9 < fp8["dense"] < 14.5e9


def test_k2_replica_gpus_by_hand(k2):
    _, r = k2
    for rep in r["rl"]["replicas"]:
        # MLA caches 512 + 64 latent values per token and layer, bfloat16: 61 x 576 x 2 bytes
        assert rep["kv_bytes_per_token"] == L * (KVL + ROPE) * 2 == 70_272
        kv = 64 * 32768 * 70_272  # rl.sampler.slots x train.seq_len
        assert rep["kv_cache"] == kv
        usable = 0.9 * 141e9
        # tensor parallel: every rank holds the whole latent cache, which exceeds a GPU's share
        assert kv > usable and rep["tensor_parallel"] is None
        # DP attention + EP: N >= (experts + KV) / (u M - the rest), then the next power of two
        bound = (rep["routed_experts"] + kv) / (usable - rep["dense"])
        assert rep["ep_bound"] == pytest.approx(bound)
        assert rep["gpus"] == 2 ** math.ceil(math.log2(bound))
    fp8, bf16 = r["rl"]["replicas"]
    assert fp8["ep_bound"] == pytest.approx(10.317, abs=1e-3) and fp8["gpus"] == 16  # two nodes of 8
    assert bf16["ep_bound"] == pytest.approx(21.04, abs=1e-2) and bf16["gpus"] == 32


def test_k2_trainer_step_by_hand_and_its_verdict(k2):
    rc, r = k2
    t, mem = r["rl"]["trainer"], r["memory_per_device"]
    # 1024 rows x 32768 tokens over 16 batch shards (fsdp 2 x expert 8) and 16 context devices
    assert t["tokens_per_device"] == 1024 * 32768 / 16 / 16 == 131_072
    assert t["micro_batch_tokens_per_device"] == 131_072 / 64
    # the batch: 6 arrays + reference log-probs (4 bytes each) and the routing int32[60 layers, top 8],
    # twice (prepare's prediction-aligned copy)
    assert t["batch"] == 131_072 * 2 * (7 * 4 + 60 * 8 * 4)
    assert t["reference_params"] == mem["params"] == t["publish_copy"]  # kl_coef 0.001: a frozen copy
    ph = t["phases"]
    assert ph["step"] == mem["total"] + t["reference_params"] + t["batch"] + t["reference_logprobs"]
    assert ph["publish"] == mem["params"] * 3 + mem["optimizer"]
    assert t["total"] == max(ph.values()) == ph["step"]
    assert r["rl"]["trainer_fits"] and rc == 0
    assert r["rl"]["trainer_headroom_fraction"] >= 0.10


def test_k2_text_report_prints_the_verdict_and_the_replica_size(capsys):
    assert main([str(K2_RL)]) == 0  # rl.vllm.quantization: fp8 is the headline's precision
    out = capsys.readouterr().out
    assert "RL trainer verdict: FITS" in out
    assert "replica size at fp8: 16 GPUs (2 nodes of 8)" in out
    assert "KV cache bfloat16 70,272 B/token -> 147.4 GB" in out
    assert "every rank holds the whole 147.4 GB latent cache" in out


def test_no_kl_no_reference_and_a_trainer_that_does_not_fit(capsys):
    rc, r = _json(capsys, str(K2_RL), "rl.loss.kl_coef=0")
    t = r["rl"]["trainer"]
    assert rc == 0 and t["reference_params"] == 0 and t["reference_forward"] == 0
    # one micro-batch: the whole step's 131K tokens per device in one forward and backward
    rc, r = _json(capsys, str(K2_RL), "train.micro_batches=1")
    assert rc == 1 and not r["rl"]["trainer_fits"]


def test_tiny_rl_config_serves_on_one_gpu_by_tensor_parallel(capsys):
    rc, r = _json(capsys, str(TINY_RL), "--device", "h200")
    rep = r["rl"]["replicas"][0]
    assert rc == 0 and rep["precision"] == "float32" and rep["tensor_parallel"] == 1 and rep["gpus"] == 1


def test_bad_replica_flags_are_named(capsys):
    assert cli_main(["inspect", str(TINY_RL), "--gpu-memory-utilization", "1.5"]) == 2
    assert "--gpu-memory-utilization 1.5: accepted: a fraction in (0, 1]" in capsys.readouterr().err
    assert cli_main(["inspect", str(TINY_RL), "--serve-precision", "int3"]) == 2
    assert "int3" in capsys.readouterr().err


def test_k2_rl_config_passes_the_learners_own_checks():
    # what `composer-jax rl` checks before it starts: 32 trainer processes (one per node), replicas by URL
    cfg = load_config(K2_RL, num_devices=None)
    check_rl_run(cfg, process_count=32, cores=[])
    assert cfg.rl.loss.advantage == "drgrpo" and cfg.rl.loss.aggregation == "token_sum"
    assert cfg.rl.group_size * cfg.rl.groups_per_step * (1 + cfg.agent.max_summaries) == cfg.train.batch_size


FLEET = ["rl.placement=ray", "rl.env_servers=3", "rl.local_samplers=2", "rl.ray.sampler_gpus=1"]


def test_a_ray_placed_trainers_hosts_are_asked_of_ray_and_counted(capsys):
    # --placement ray on `rl` (train.placement: ray): 2 trainer hosts of 8 GPUs, one actor each
    trainer = ["train.placement=ray", "train.ray.hosts=2", "train.ray.gpus_per_host=8", "train.ray.cpus_per_host=4"]
    rc, r = _json(capsys, str(TINY_RL), *FLEET, *trainer, "mesh.data=4", "--device", "h100")
    t = r["rl"]["ray_resources"]["trainer"]
    assert (t["placed_by_ray"], t["hosts"], t["cpus"], t["gpus"], t["resource"]) == (True, 2, 4.0, 8, "trainer")
    # the totals: 2 replicas x (1 CPU, 1 GPU) + 3 servers x 1 CPU + 2 hosts x (4 CPUs, 8 GPUs)
    assert r["rl"]["ray_resources"]["totals"] == {
        "cpus": 13.0,
        "gpus": 18,
        "custom": {"sampler": 2, "env_server": 3, "trainer": 2},
    }
    assert main([str(TINY_RL), *FLEET, *trainer, "mesh.data=4", "--device", "h100"]) == 0
    out = capsys.readouterr().out
    assert (
        "trainer          2 hosts x 8 GPUs = 2 x (4 CPUs, 8 GPUs, 1 trainer)   (mesh of 16 devices; placed by Ray: "
        "one actor per host, STRICT_SPREAD, joined by jax.distributed (train.ray))" in out
    )
    assert "total            13 CPUs, 18 GPUs, sampler 2, env_server 3, trainer 2\n" in out


def test_a_ray_placed_fleets_resources_by_hand(capsys):
    # tiny_families: mesh data 2 x fsdp 2 x expert 2 = 8 devices; sized for no device, a CPU run
    assert main([str(TINY_RL), *FLEET]) == 0
    out = capsys.readouterr().out
    assert "resources the run asks Ray for (rl.placement: ray; cluster: RAY_ADDRESS, else a local one" in out
    # the trainer is the driver, not a Ray actor: sized for its node, left out of the totals
    assert (
        "trainer          1 host x 8 CPU devices   (mesh of 8 devices; not placed by Ray: the driver, on the node "
        "where the command runs; no accelerator" in out
    )
    assert "STRICT_SPREAD" not in out and "actor per host" not in out
    assert "sampler replicas 2 x (1 CPU, 1 GPU, 1 sampler)   (serve, rl.local_samplers)" in out
    assert "env servers      3 x (1 CPU, 1 env_server)   (rl.env_servers)" in out
    # CPUs 2 replicas x 1 + 3 servers x 1 = 5; GPUs 2 x 1; one unit of the custom resource per actor
    total = "total            5 CPUs, 2 GPUs, sampler 2, env_server 3 (the trainer not counted: it runs outside Ray)"
    assert total in out
    # on H100s: the 8 devices are one host's 8 GPUs, the driver node's, not asked of Ray (the GPU total
    # is the replicas' alone); 16 devices are two hosts; fractional CPUs per actor: 2 x 2 + 3 x 0.5 = 5.5
    more = ["rl.ray.sampler_cpus=2", "rl.ray.env_server_cpus=0.5", "rl.ray.address=auto"]
    rc, r = _json(capsys, str(TINY_RL), *FLEET, *more, "--device", "h100")
    x = r["rl"]["ray_resources"]
    assert (x["placement"], x["address"]) == ("ray", "auto")
    assert x["trainer"] == {
        "accelerator": "gpu",
        "devices": 8,
        "devices_per_host": 8,
        "hosts": 1,
        "even": True,
        "placed_by_ray": False,
    }
    assert x["totals"] == {"cpus": 5.5, "gpus": 2, "custom": {"sampler": 2, "env_server": 3}}
    argv = [str(TINY_RL), *FLEET, "mesh.data=4", "--device", "h100"]
    rc, r = _json(capsys, *argv)
    t = r["rl"]["ray_resources"]["trainer"]
    assert (t["hosts"], t["devices_per_host"], t["devices"]) == (2, 8, 16)
    assert r["rl"]["ray_resources"]["totals"]["gpus"] == 2
    assert main(argv) == 0
    assert (
        "trainer          2 hosts x 8 GPUs   (mesh of 16 devices; not placed by Ray: the command on each host, "
        "joined by jax.distributed (docs/scaling.md))" in capsys.readouterr().out
    )


def test_a_local_fleet_says_what_ray_would_be_asked_and_urls_place_nothing(capsys, k2):
    assert main([str(TINY_RL), "rl.ray.env_server_resource=", "rl.ray.sampler_resource="]) == 0
    out = capsys.readouterr().out
    assert "resources the run would ask Ray for (rl.placement: local:" in out
    # the config's one environment server, no custom resource; no replica: the in-process sampler
    assert "env servers      1 x (1 CPU)   (rl.env_servers)" in out
    assert "sampler replicas none   (the in-process sampler, rl.local_samplers)" in out
    assert "total            1 CPU, 0 GPUs (the trainer not counted: it runs outside Ray)" in out
    # K2: mesh h200x256 on its train.device h200: 256 / 8 = 32 hosts (the config's "32 nodes x 8 H200");
    # replicas and environment servers by URL run elsewhere: nothing placed for them
    x = k2[1]["rl"]["ray_resources"]
    assert (x["trainer"]["hosts"], x["trainer"]["devices_per_host"]) == (32, 8)
    assert (x["replicas"]["count"], x["replicas"]["by_url"], x["env_servers"]["count"]) == (0, 8, 0)
    assert x["trainer"]["placed_by_ray"] is False
    assert x["totals"] == {"cpus": 0, "gpus": 0, "custom": {}}  # the trainer's 256 GPUs are not Ray's


def test_vllm_replicas_are_placed_by_ray_with_their_gpus(capsys):
    # a tensor-parallel vLLM replica asks Ray for its GPUs as one actor's (one node's)
    argv = [str(TINY_RL), "rl.local_samplers=2", "rl.sampler_engine=vllm", "rl.placement=ray", "rl.ray.sampler_gpus=2"]
    assert main([*argv, "rl.vllm.extra_args=[--tensor-parallel-size, '2']", "--device", "h100"]) == 0
    assert "sampler replicas 2 x (1 CPU, 2 GPUs, 1 sampler)   (vllm, rl.local_samplers)" in capsys.readouterr().out


def test_lora_rl_trainer_has_no_reference_copy(capsys):
    """With train.lora the frozen base is the KL reference: no copy of it (the full run keeps one
    the size of its parameters)."""
    _, full = _json(capsys, str(TINY_RL), "rl.loss.kl_coef=0.01")
    rc, r = _json(capsys, str(TINY_RL), "rl.loss.kl_coef=0.01", "train.lora.rank=4")
    assert full["rl"]["trainer"]["reference_params"] == full["memory_per_device"]["params"] > 0
    assert rc == 0 and r["rl"]["trainer"]["reference_params"] == 0 and r["lora"]["trainable_params"] > 0
    assert main([str(TINY_RL), "rl.loss.kl_coef=0.01", "train.lora.rank=4"]) == 0
    assert "(none: with train.lora the frozen base is the reference)" in capsys.readouterr().out
