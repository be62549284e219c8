"""The vLLM sampler's pieces that need no running engine: the generate request as vLLM's own
protocol classes parse it (vLLM's virtualenv is the oracle), `weight_versions` spans to per-token
versions, routed experts decoding, the replica's arguments, the config's errors, and the run's
router-replay setting. The engine itself: tests/rl/samplers/test_vllm_sampler.py (slow)."""

from __future__ import annotations

import base64
import io
import json
import subprocess
from pathlib import Path

import numpy as np
import pytest

from composer_jax.config import ConfigError, load_config
from composer_jax.config.vllm import VLLMConfig
from composer_jax.rl.samplers.policy import SamplerUnavailable, TurnRequest
from composer_jax.rl.samplers.vllm import decode_routed_experts, generate_body, token_versions
from composer_jax.rl.samplers.vllm_launch import needs_padding, vllm_args, with_vllm_settings
from composer_jax.weightsync.nccl import finish_body, init_body, update_body

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = REPO / ".venv" / "vllm" / "bin" / "python"
CONFIG = REPO / "tests" / "rl" / "fixtures" / "rl_vllm.yaml"

# run by vLLM's interpreter: parse the bodies with vLLM's own request classes and print what it read
_PARSE = """
import json, sys
from vllm.entrypoints.scale_out.token_in_token_out.protocol import GenerateRequest
body = json.loads(sys.argv[1])
r = GenerateRequest.model_validate(body)
sp = r.sampling_params
print(json.dumps({"token_ids": r.token_ids, "max_tokens": sp.max_tokens, "temperature": sp.temperature,
    "top_p": sp.top_p, "top_k": sp.top_k, "seed": sp.seed, "logprobs": sp.logprobs, "stop": sp.stop_token_ids,
    "ignore_eos": sp.ignore_eos, "detokenize": sp.detokenize, "mode": r.output_mode}))
from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo
init = NCCLWeightTransferInitInfo(**json.loads(sys.argv[2])["init_info"])
update = NCCLWeightTransferUpdateInfo(**json.loads(sys.argv[3])["update_info"])
print(json.dumps({"uid": init.nccl_unique_id_bytes.hex(), "offset": init.rank_offset, "world": init.world_size,
    "packed": init.packed, "names": update.names, "dtypes": update.dtype_names, "shapes": update.shapes}))
"""


def _vllm_python() -> Path:
    if not VLLM_PYTHON.exists():
        pytest.skip("vLLM's virtualenv (.venv/vllm) is missing: `make venv` builds it from locks/vllm.lock")
    return VLLM_PYTHON


def test_request_bodies_are_what_vllm_reads():
    """The generate request and the NCCL weight-transfer bodies, parsed by vLLM's own classes."""
    body = generate_body([5, 6, 7], TurnRequest(max_tokens=24, seed=11, temperature=0.7, top_p=0.9, top_k=0), 3)
    uid = bytes(range(128))
    init = init_body(uid, rank_offset=9, world_size=17)
    specs = [("model.embed_tokens.weight", "bfloat16", (8, 4), None), ("lm_head.weight", "float32", (8, 4), None)]
    bodies = [json.dumps(b) for b in (body, init, update_body(specs))]
    out = subprocess.run([str(_vllm_python()), "-c", _PARSE, *bodies], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    *_, line, nccl = out.stdout.strip().splitlines()
    got = json.loads(nccl)
    assert got["uid"] == uid.hex() and (got["offset"], got["world"], got["packed"]) == (9, 17, False)
    assert got["names"] == [s[0] for s in specs] and got["dtypes"] == ["bfloat16", "float32"]
    assert got["shapes"] == [[8, 4], [8, 4]]
    assert finish_body(4) == {"weight_version": "4"}
    read = json.loads(line)
    assert read["token_ids"] == [5, 6, 7] and read["max_tokens"] == 24 and read["seed"] == 11
    assert read["temperature"] == pytest.approx(0.7) and read["top_p"] == pytest.approx(0.9)
    assert read["top_k"] in (-1, 0)  # vLLM's "every token" (it normalises -1)
    assert read["logprobs"] == 0 and read["stop"] == [3] and read["ignore_eos"] is True
    assert read["detokenize"] is False and read["mode"] == "tokens"


def test_weight_version_spans_become_per_token_versions():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert token_versions(spans, 5, "r") == [3, 3, 4, 4, 4]
    with pytest.raises(SamplerUnavailable, match="labelled 'default'"):
        token_versions([{"version": "default", "start": 0, "end": 2}], 2, "r")
    with pytest.raises(SamplerUnavailable, match="do not cover"):
        token_versions([{"version": "1", "start": 0, "end": 1}], 2, "r")
    with pytest.raises(SamplerUnavailable, match="outside"):
        token_versions([{"version": "1", "start": 0, "end": 3}], 2, "r")
    with pytest.raises(SamplerUnavailable, match="no weight_versions"):
        token_versions(None, 2, "r")


def test_routed_experts_decode_as_vllm_encodes_them():
    rows = np.arange(2 * 3 * 2, dtype=np.uint16).reshape(2, 3, 2)
    buf = io.BytesIO()
    np.save(buf, rows)  # what vLLM sends: base64 of the .npy bytes
    got = decode_routed_experts(base64.b64encode(buf.getvalue()).decode())
    assert got.dtype == np.int32 and np.array_equal(got, rows)


def test_replica_arguments():
    v = VLLMConfig(extra_args=("--seed", "3"))
    args = vllm_args(v, "/m", 192, cpu=True)
    assert args[:2] == ["--model", "/m"] and "--skip-tokenizer-init" in args and args[-2:] == ["--seed", "3"]
    assert args[args.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert args[args.index("--attention-backend") + 1] == "CPU_MLA" and "--enforce-eager" in args
    gpu = vllm_args(VLLMConfig(routed_experts=True, weight_update="nccl", nccl_host="h"), "/m", 8, cpu=False)
    assert "--attention-backend" not in gpu and "--enable-return-routed-experts" in gpu
    assert json.loads(gpu[gpu.index("--weight-transfer-config") + 1]) == {"backend": "nccl"}


def test_config_errors_name_the_value():
    base: list[str] = []
    for bad, said in [
        (["rl.sampler_engine=vlm"], "rl.sampler_engine='vlm' is not accepted"),
        (["rl.local_samplers=0"], "needs replicas"),
        (["rl.vllm.dtype=float16"], "rl.vllm.dtype='float16'"),
        (["rl.vllm.kv_cache_bytes=lots"], "rl.vllm.kv_cache_bytes='lots'"),
        (["rl.vllm.weight_update=ipc"], "rl.vllm.weight_update='ipc'"),
        (["rl.local_samplers=0", "rl.sampler_urls=[http://a:1]"], "weight_update='restart' with rl.sampler_urls"),
        (
            ["rl.local_samplers=0", "rl.sampler_urls=[http://a:1]", "rl.vllm.weight_update=nccl"],
            "needs rl.vllm.nccl_host",
        ),
    ]:
        with pytest.raises(ConfigError, match=said.replace("[", r"\[").replace("(", r"\(")):
            load_config(CONFIG, base + bad)


def test_router_replay_is_turned_off_and_said_without_routed_experts():
    cfg = load_config(CONFIG, [])
    said: list[str] = []
    assert cfg.rl.loss.router_replay and cfg.model.num_moe_layers > 0
    off = with_vllm_settings(cfg, said.append)
    assert not off.rl.loss.router_replay and "router replay off" in said[0]
    on = load_config(CONFIG, ["rl.vllm.routed_experts=true"])
    assert with_vllm_settings(on, said.append) is on and len(said) == 1


def test_mla_widths_vllm_cpu_cannot_take_are_padded_or_refused():
    cfg = load_config(CONFIG, [])
    assert needs_padding(cfg.model, cpu=True) and not needs_padding(cfg.model, cpu=False)
    wide = load_config(CONFIG, ["model.kv_lora_rank=512", "model.qk_rope_head_dim=64"])
    assert not needs_padding(wide.model, cpu=True)
    odd = load_config(CONFIG, ["model.kv_lora_rank=48"])
    with pytest.raises(ConfigError, match="cannot be padded to it exactly"):
        needs_padding(odd.model, cpu=True)
