"""`composer-jax inspect` and model/accounting.py against hand-worked counts and published figures."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import pytest

from composer_jax.cli import main as cli_main
from composer_jax.config import load_config, read_yaml
from composer_jax.inspection import build_report, main
from composer_jax.model.params import abstract_params

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "configs" / "model"
MESHES = ROOT / "configs" / "mesh"


def _cfg(name: str, overrides=()):
    return load_config(MODELS / f"{name}.yaml", overrides, num_devices=None)


def _counts(name: str, overrides=()):
    cfg = _cfg(name, overrides)
    report = build_report(cfg, {"data": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}, None, 128)
    return report["params"]


# --------------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", sorted(MODELS.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_model_config_loads_and_validates(path):
    cfg = load_config(path, num_devices=None)
    assert cfg.model.name == path.stem


@pytest.mark.parametrize("mesh", sorted(MESHES.glob("*.yaml")), ids=lambda p: p.stem)
@pytest.mark.parametrize("model", ["kimi_k2", "deepseek_v3", "qwen3_moe_30b_a3b", "tiny"])
def test_every_mesh_config_composes_with_the_real_models(mesh, model):
    assert main([str(MODELS / f"{model}.yaml"), "--mesh", str(mesh), "--json"]) == 0


# --------------------------------------------------------------------------------------------------
# Parameter counts
# --------------------------------------------------------------------------------------------------


def test_tiny_count_by_hand():
    # configs/model/tiny.yaml: V=512 d=64, 3 layers (1 dense + 2 MoE), 4 heads, MLA q_lora 32,
    # kv_lora 32, nope 16, rope 8, v 16; dense MLP 128; 8 experts of width 32, top-2, 1 shared; 1 MTP.
    #   attention/layer = q_a 64*32 + q_b 32*4*(16+8) + kv_a 64*(32+8) + kv_b 32*4*(16+16) + o 4*16*64
    #                   = 2048 + 3072 + 2560 + 4096 + 4096 = 15872, + q_a_norm 32 + kv_a_norm 32 = 15936
    #   layer norms 2*64 = 128; dense MLP 3*64*128 = 24576
    #   MoE = router 64*8 + bias 8 + experts 3*8*64*32 + shared 3*64*32 = 512 + 8 + 49152 + 6144 = 55816
    #   dense layer 15936+128+24576 = 40640; MoE layer 15936+128+55816 = 71880
    #   total = embed 512*64 + 40640 + 2*71880 + final norm 64 + lm_head 64*512
    #         = 32768 + 40640 + 143760 + 64 + 32768 = 250000
    #   active: routed experts at 2/8: each MoE layer 71880 - 49152 + 12288 = 35016
    #         = 32768 + 40640 + 2*35016 + 64 + 32768 = 176272
    #   MTP = enorm 64 + hnorm 64 + eh_proj 128*64 + MoE layer 71880 + norm 64 = 80264
    p = _counts("tiny")
    assert p["total"] == 250_000
    assert p["active"] == 176_272
    assert p["mtp_total"] == 80_264
    assert p["components"]["routed_experts"] == {
        "total": 98_304,
        "active": 24_576,
        "bytes": 98_304 * 4,
        "bytes_per_device": 98_304 * 4,
    }


def test_tied_embedding_counted_once():
    untied, tied = _counts("tiny"), _counts("tiny", ["model.tie_word_embeddings=true"])
    assert untied["total"] - tied["total"] == 512 * 64
    assert "lm_head" not in tied["components"]


# Published figures. Kimi K2: "1.04 trillion total parameters, 32 billion activated" (arXiv
# 2507.20534 abstract; moonshotai/Kimi-K2-Instruct model card). Our count of the hub shapes is
# 1.026T / 32.9B: the paper rounds, and third-party counts of the safetensors give 1.026T too.
# DeepSeek-V3: "671B total parameters with 37B activated for each token" (arXiv 2412.19437
# abstract); the hub's 685B adds the 14B MTP module, which stores its own copy of the embedding and
# output head (2 x 129280 x 7168 = 1.85B) that composer_jax shares with the main model.
# Qwen3-30B-A3B: "30.5B total, 3.3B activated" (Qwen/Qwen3-30B-A3B model card, arXiv 2505.09388).
@pytest.mark.parametrize(
    "name,total,active,tol",
    [
        ("kimi_k2", 1.04e12, 32e9, 0.03),
        ("kimi_k2_5", 1.04e12, 32e9, 0.03),
        ("deepseek_v3", 671e9, 37e9, 0.02),
        ("qwen3_moe_30b_a3b", 30.5e9, 3.3e9, 0.02),
    ],
)
def test_published_parameter_counts(name, total, active, tol):
    p = _counts(name)
    assert p["total"] == pytest.approx(total, rel=tol)
    assert p["active"] == pytest.approx(active, rel=tol)


def test_deepseek_v3_mtp_module_is_about_14b_with_the_hub_copies_of_embedding_and_head():
    p = _counts("deepseek_v3")
    assert p["mtp_total"] + 2 * 129280 * 7168 == pytest.approx(14e9, rel=0.05)


def test_eval_shape_of_init_allocates_nothing():
    cfg = _cfg("kimi_k2").model  # 1.03T parameters: ~2 TB if anything were materialised
    before = len(jax.live_arrays())
    shapes = abstract_params(cfg)
    leaves = jax.tree.leaves(shapes)
    assert leaves and all(isinstance(x, jax.ShapeDtypeStruct) for x in leaves)
    assert len(jax.live_arrays()) <= before


# --------------------------------------------------------------------------------------------------
# FLOPs and memory
# --------------------------------------------------------------------------------------------------


def test_tiny_flops_by_hand():
    # matmul params = active 176272 - embedding gather 32768 - norms 640 - router biases 2*8 = 142848
    # attention at seq 128: 12 * 3 layers * 4 heads * (24 + 16)/2 * S_ctx, S_ctx = 64 (causal) or 128
    f = build_report(_cfg("tiny"), {"data": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}, None, 128)[
        "flops_per_token"
    ]
    assert f["matmul_active_params"] == 142_848
    assert f["attention_causal"] == 12 * 3 * 4 * 20 * 64
    assert f["total"] == 6 * 142_848 + 12 * 3 * 4 * 20 * 64
    assert f["total_full_attention"] == 6 * 142_848 + 12 * 3 * 4 * 20 * 128


def test_kimi_per_device_parameter_bytes_by_hand():
    # Mesh fsdp=32 x expert=8 (256 devices), default rules. Routed expert weights
    # [60 layers, 384 experts, 7168, 2048] (x3: gate, up, down) are split over experts by `expert`
    # (384/8) and over the model dimension 7168 by `fsdp` (7168/32): 256 shards of bfloat16.
    # The embedding [163840, 7168] is split over its model dimension only: 32 shards.
    cfg = _cfg("kimi_k2", ["mesh.fsdp=32", "mesh.expert=8"])
    sizes = {"data": 1, "fsdp": 32, "expert": 8, "context": 1, "tensor": 1}
    c = build_report(cfg, sizes, 256, 4096)["params"]["components"]
    assert c["routed_experts"]["bytes_per_device"] == 3 * 60 * 384 * 7168 * 2048 * 2 // 256
    assert c["embedding"]["bytes_per_device"] == 163840 * 7168 * 2 // 32


def test_tiny_state_memory_by_hand():
    # float32 parameters on one device: params 4 B, grads 4 B, AdamW moments 8 B per scalar, no
    # master copy; all 250000 + 80264 (MTP) scalars are live parameters.
    cfg = _cfg("tiny")
    mem = build_report(cfg, {"data": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}, 2, 64)["memory_per_device"]
    n = 250_000 + 80_264
    assert mem["params"] == mem["grads"] == 4 * n
    assert mem["optimizer"] == 8 * n
    # bfloat16 parameters: 2 B each except the float32 router weights and biases (2 MoE layers + 1
    # MTP layer) x (64*8 + 8) = 1560 scalars. AdamW's moments take the parameter dtype (optax's
    # default, train/optimizer.py): 2 x 2 B, or 2 x 4 B for the routers.
    one = {"data": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}
    mem16 = build_report(_cfg("tiny", ["model.param_dtype=bfloat16"]), one, 2, 64)["memory_per_device"]
    assert mem16["params"] == 2 * (n - 1560) + 4 * 1560
    assert mem16["optimizer"] == 4 * (n - 1560) + 8 * 1560
    # --fp32-master sizes the sound bfloat16 recipe: float32 moments (8 B) plus a float32 master
    # copy (4 B) of every bfloat16 parameter; the float32 routers need no master copy
    mem16m = build_report(_cfg("tiny", ["model.param_dtype=bfloat16"]), one, 2, 64, fp32_master=True)
    assert mem16m["memory_per_device"]["optimizer"] == 12 * (n - 1560) + 8 * 1560


def test_lora_trainable_parameters_and_optimizer_saving_by_hand(capsys):
    """train.lora (rank 8, alpha 16, the attention projections) on the tiny model: an adapter pair
    A [in, 8], B [8, out] per projection and layer, float32. Per layer: q_a 64*8 + 8*32 = 768,
    q_b 32*8 + 8*4*24 = 1024, kv_a 64*8 + 8*40 = 832, kv_b 32*8 + 8*4*32 = 1280, o 4*16*8 + 8*64 =
    1024: 4928, x 3 layers (the MTP module keeps its base) = 14,784. AdamW's state: 2 float32
    moments per trained scalar, 8 x 330,264 B full fine-tuning vs 8 x 14,784 B with LoRA."""
    n, trained = 250_000 + 80_264, 3 * 4928
    one = {"data": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}
    r = build_report(_cfg("tiny", ["train.lora.rank=8"]), one, 2, 64)
    x, mem = r["lora"], r["memory_per_device"]
    assert (x["trainable_params"], x["model_params"], x["adapter_bytes"]) == (trained, n, 4 * trained)
    assert x["optimizer_bytes"] == {"full": 8 * n, "lora": 8 * trained}
    assert x["optimizer_bytes_per_device"] == {"full": 8 * n, "lora": 8 * trained}
    # the run's memory: the frozen base + the adapters; gradients and moments of the adapters only
    full = build_report(_cfg("tiny"), one, 2, 64)["memory_per_device"]
    assert (mem["params"], mem["grads"], mem["optimizer"]) == (4 * (n + trained), 4 * trained, 8 * trained)
    # (FSDP buffers and activations as full fine-tuning's: + 4 t params, - 4 (n - t) grads, - 8 (n - t) moments)
    assert full["total"] - mem["total"] == 12 * n - 16 * trained
    assert "lora" not in build_report(_cfg("tiny"), one, 2, 64)
    # the text: the trainable share and both optimiser sizes
    assert main([str(MODELS / "tiny.yaml"), "train.lora.rank=8", "mesh.fsdp=1"]) == 0
    out = capsys.readouterr().out
    assert f"14.8K ({trained:,}) adapter parameters" in out
    assert f"AdamW state {8 * n:,} B full fine-tuning vs {8 * trained:,} B with LoRA (22.3x less)" in out


def test_lora_quantised_base_bytes(capsys):
    """train.lora.base_format=mxfp8 on the tiny model: the LoRA report's frozen base is the stored
    bytes of the real quantisation (`jax.eval_shape` of `quant_base.quantize_base`, whose codes +
    scales tests/model/test_quant_base.py computes by hand), the memory estimate's parameters are
    that + the adapters, and its activations are remat dots's (a quantised base runs remat none as
    dots)."""
    from composer_jax.model import quant_base

    one = {"data": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}
    cfg = _cfg("tiny", ["train.lora.rank=8", "train.lora.base_format=mxfp8"])
    stored = quant_base.stored_bytes(
        jax.eval_shape(lambda b: quant_base.quantize_base(b, cfg.model, "mxfp8"), abstract_params(cfg.model))
    )
    r = build_report(cfg, one, 2, 64)
    x, mem = r["lora"], r["memory_per_device"]
    trained, n = 3 * 4928, 250_000 + 80_264
    assert (x["base_bytes"], x["base_bytes_per_device"], x["base_float_bytes"]) == (stored, stored, 4 * n)
    assert x["quantised_bytes"]["stored"] == stored - 4 * (n - x["quantised_bytes"]["float"] // 4)
    assert mem["params"] == stored + 4 * trained
    dots = build_report(_cfg("tiny", ["train.lora.rank=8", "model.remat=dots"]), one, 2, 64)
    assert mem["activations"] == dots["memory_per_device"]["activations"]
    assert 0.25 < x["quantised_bytes"]["stored"] / x["quantised_bytes"]["float"] < 0.3  # ~ (1 + 1/32) / 4
    assert main([str(MODELS / "tiny.yaml"), "train.lora.rank=8", "train.lora.base_format=mxfp8", "mesh.fsdp=1"]) == 0
    assert f"frozen base {stored:,} B stored (mxfp8; {4 * n:,} B in the parameter dtype" in capsys.readouterr().out


def test_remat_orders_activation_memory():
    sizes = {"data": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}
    act = {
        p: build_report(_cfg("tiny", [f"model.remat={p}"]), sizes, 4, 256)["memory_per_device"]["activations"]
        for p in ("none", "dots", "full")
    }
    assert act["none"]["total"] > act["dots"]["total"] > act["full"]["total"]
    # remat=full keeps one [tokens, hidden] input per layer (3 + 1 MTP) plus one layer's working set
    assert act["full"]["layers"] > 4 * 4 * 256 * 64 * 4


# --------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------


def test_cli_json(capsys):
    rc = main(
        [
            str(MODELS / "deepseek_v3.yaml"),
            "mesh.fsdp=64",
            "mesh.expert=8",
            "--batch",
            "512",
            "--seq",
            "4096",
            "--device-memory-gib",
            "140",
            "--json",
        ]
    )
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert r["devices"] == 512 and r["mesh"]["fsdp"] == 64
    assert r["params"]["total"] == pytest.approx(671e9, rel=0.01)
    assert isinstance(r["fits"], bool) and r["memory_per_device"]["total"] > 0
    assert r["config"]["model"]["name"] == "deepseek_v3"


def test_cli_text(capsys):
    assert (
        main(
            [
                str(MODELS / "qwen3_moe_30b_a3b.yaml"),
                "--mesh",
                str(MESHES / "h200x64_ep8.yaml"),
                "--batch",
                "64",
                "--device-memory-gib",
                "140",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "routed_experts" in out and "training FLOPs/token" in out
    assert "verdict: FITS" in out and "140.00 GiB" in out


@pytest.mark.parametrize(
    "args,needle",
    [
        (["model.num_layrs=2"], "did you mean 'num_layers'"),
        (["mesh.expert=5"], "accepted expert sizes"),
        (["mesh.fsdp=2", "--batch", "3"], "accepted: a positive multiple of 2"),
        (["mesh.fsdp=2", "--batch", "4", "--micro-batches", "4"], "accepted: a positive multiple of 8"),
        (["--micro-batches", "0"], "--micro-batches 0: accepted: a positive integer"),
        (
            ["--device", "h300"],
            "device 'h300' (--device or train.device) is not known; accepted: a100-80gb, h100, h200",
        ),
        (["--device", "h200", "--device-memory-gib", "80"], "not allowed with argument"),
        (["--min-headroom", "1.5", "--device", "h200"], "--min-headroom 1.5: accepted: a fraction in [0, 1)"),
        (["mesh.context=2", "--seq", "102"], "must be a positive multiple of 2 x mesh.context = 4"),
        (["--seq", "100000"], "exceeds model.max_position_embeddings=4096"),
        (["--batch", "x"], "invalid int value: 'x'"),
        (["--mesh", "no/such.yaml"], "does not exist"),
        (["--device-memory-gib", "0"], "must be positive"),
    ],
)
def test_cli_bad_arguments_exit_2_with_a_clear_message(capsys, args, needle):
    assert cli_main(["inspect", str(MODELS / "tiny.yaml"), *args]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.startswith("composer-jax inspect: error:")


def test_cli_mesh_file_must_hold_only_a_mesh_section(capsys):
    assert cli_main(["inspect", str(MODELS / "tiny.yaml"), "--mesh", str(MODELS / "tiny.yaml")]) == 2
    assert "must hold only a `mesh:` section" in capsys.readouterr().err


def test_cli_without_config_names_what_is_missing(capsys):
    assert cli_main(["inspect"]) == 2
    assert "missing CONFIG" in capsys.readouterr().err


def test_cli_directory_instead_of_a_config_file(capsys):
    assert cli_main(["inspect", str(MODELS)]) == 2
    err = capsys.readouterr().err
    assert str(MODELS) in err and "is not a file" in err and "Traceback" not in err


def test_cli_lists_dimensions_the_mesh_cannot_split(capsys):
    # neither hidden 64 (`embed`) nor the LoRA rank 32 (`lora_in`) is divisible by fsdp=3, so both
    # stay whole over fsdp: every FSDP-sharded parameter of the tiny model is listed
    assert main([str(MODELS / "tiny.yaml"), "mesh.fsdp=3", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert {"path": "embed", "logical_axis": "embed", "mesh_axis": "fsdp", "dim": 64} in r["unsplit_axes"]
    assert {"path": "moe_layers/attn/q_b", "logical_axis": "lora_in", "mesh_axis": "fsdp", "dim": 32} in r[
        "unsplit_axes"
    ]
    assert {(u["logical_axis"], u["mesh_axis"], u["dim"]) for u in r["unsplit_axes"]} == {
        ("embed", "fsdp", 64),
        ("lora_in", "fsdp", 32),
    }
    assert main([str(MODELS / "tiny.yaml"), "mesh.fsdp=4", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["unsplit_axes"] == []


# --------------------------------------------------------------------------------------------------
# Training configs: the stage's own shape, a verdict against the hardware it names
# --------------------------------------------------------------------------------------------------

PRETRAIN = ROOT / "configs" / "pretrain"


def _named_hardware(path: Path) -> str:
    return read_yaml(path).get("train", {}).get("device", "")


# every config under configs/ that names the hardware it is sized for (train.device): the real-size
# pretraining stages and the RL run (configs/rl/kimi_k2_h200.yaml; tests/test_inspect_rl.py has its RL figures)
REAL_SIZE = sorted(p for p in (ROOT / "configs").rglob("*.yaml") if _named_hardware(p))


def test_the_three_real_stages_name_their_hardware():
    assert {p.stem for p in REAL_SIZE} >= {"stage1_32k", "stage2_256k", "stage3_sft"}
    # the report's pilot, stage 1 to RL from Qwen3-30B-A3B's Hugging Face checkpoint
    assert {p.stem for p in REAL_SIZE} >= {"qwen3_30b_a3b_stage1", "qwen3_30b_a3b_sft", "qwen3_30b_a3b_rl"}


@pytest.mark.parametrize("path", REAL_SIZE, ids=lambda p: p.stem)
def test_every_real_size_config_fits_the_hardware_it_names(path, capsys):
    rc = main([str(path), "--json"])
    r = json.loads(capsys.readouterr().out)
    cfg = load_config(path, num_devices=None)
    # inspect sized the stage as the stage runs it, not a default 4K sequence
    assert (r["batch"], r["seq"], r["micro_batches"]) == (
        cfg.train.batch_size,
        cfg.train.seq_len,
        cfg.train.micro_batches,
    )
    assert r["device"]["name"] == cfg.train.device
    assert r["devices"] == (64 if "pilot" in path.parts else 256)  # the pilot: 8 nodes; the report's stages: 32
    assert rc == 0 and r["fits"], f"{path.name}: {r['memory_per_device']['total'] / 2**30:.1f} GiB per device"
    assert r["headroom_fraction"] >= 0.10


def test_stage2_text_report_prints_the_stage_shape_and_a_verdict(capsys):
    assert main([str(PRETRAIN / "stage2_256k.yaml")]) == 0
    out = capsys.readouterr().out
    assert "batch 8 x seq 262144 = 2,097,152 tokens/step, 2 micro-batches of 4,096 tokens per device" in out
    assert "NVIDIA H200 SXM, 141 GB" in out and "verdict: FITS" in out


def test_stage2_zero3_rules_split_parameters_over_the_context_axis_by_hand():
    # stage 2: mesh expert=4 x context=64, sharding_rules embed/lora_in -> [fsdp, context, data].
    # Routed experts [60 layers, 384 experts, 7168, 2048] x 3 (gate, up, down): experts over
    # `expert` (384/4), the model dimension 7168 over `context` (7168/64 = 112): 256 shards.
    # The embedding [163840, 7168] splits its model dimension over context only: 64 shards.
    cfg = load_config(PRETRAIN / "stage2_256k.yaml", num_devices=None)
    sizes = {"data": 1, "fsdp": 1, "expert": 4, "context": 64, "tensor": 1}
    r = build_report(cfg, sizes, 8, 262144, micro_batches=2)
    c = r["params"]["components"]
    assert c["routed_experts"]["bytes_per_device"] == 3 * 60 * 384 * 7168 * 2048 * 2 // 256
    assert c["embedding"]["bytes_per_device"] == 163840 * 7168 * 2 // 64
    assert r["replicated_params"] == [] and r["unsplit_axes"] == []
    # AdamW moments take the parameters' dtype and sharding: exactly twice the parameter bytes
    mem = r["memory_per_device"]
    assert mem["optimizer"] == 2 * mem["params"]


def test_the_old_stage2_mesh_does_not_fit_and_exits_1(capsys):
    # the 4-way context mesh the stage used to name, with the default (non-ZeRO) rules: experts split
    # 64 ways, the rest 8 ways; far beyond an H200, so inspect says so and exits 1 (a launch gate)
    rc = main(
        [
            str(PRETRAIN / "stage2_256k.yaml"),
            "--mesh",
            str(MESHES / "h200x256_ep8_cp4.yaml"),
            "sharding_rules={}",
            "--micro-batches",
            "1",
            "--batch",
            "64",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 1 and "verdict: DOES NOT FIT" in out


def test_verdict_headroom_by_hand(capsys):
    # the verdict compares the printed total with the device: headroom = capacity - total, and a
    # device exactly 10% larger than the total fits at --min-headroom 0.09 but not at 0.1
    sizes = {"data": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}
    total = build_report(_cfg("tiny"), sizes, 2, 64)["memory_per_device"]["total"]
    gib = total / 0.9 / 2**30
    r = build_report(_cfg("tiny"), sizes, 2, 64, gib, min_headroom=0.09)
    assert r["headroom_bytes"] == pytest.approx(total / 0.9 - total)
    assert r["headroom_fraction"] == pytest.approx(0.1)
    assert r["fits"]
    assert not build_report(_cfg("tiny"), sizes, 2, 64, gib * 0.999, min_headroom=0.1)["fits"]
    # the data-sheet table: an H200 is 141 GB = 141e9 bytes
    r = build_report(_cfg("tiny"), sizes, 2, 64, device="h200")
    assert r["device"]["memory_bytes"] == 141e9 and r["fits"]


def test_cli_xla_needs_the_mesh_to_fit_this_machine(capsys):
    # the test session has 8 CPU devices; a 16-device mesh cannot be compiled here
    assert cli_main(["inspect", str(PRETRAIN / "tiny_stage1.yaml"), "mesh.data=4", "train.batch_size=16", "--xla"]) == 2
    err = capsys.readouterr().err
    assert "--xla compiles the step on this machine's 8 cpu device(s)" in err and "= 16" in err


def test_expert_all_to_all_bytes_by_hand_on_the_stage1_mesh(capsys):
    """Stage 1 (Kimi K2.5, EP 8, 2,048 tokens per device per micro-batch, 16 micro-batches, 60 MoE
    layers, hidden 7,168 in bfloat16, remat full). Per layer and exchange one device sends, padded,
    (8 - 1) x 2,048 x 8 = 114,688 rows of 14,336 bytes = 1,644,167,168 bytes; ragged, at uniform
    routing, 7/8 of its 16,384 assignments = 14,336 rows = 205,520,896 bytes. x 6 exchanges x 60
    layers x 16 micro-batches = 9.470e12 / 1.184e12 bytes per step. Metadata per forward pass
    (2 with remat): padded 114,688 int32 ids, ragged 7 x 384 int32 counts. The context axis (16)
    is innermost, so an expert group spans 8 x 16 devices: InfiniBand, 50 GB/s."""
    cfg = load_config(PRETRAIN / "stage1_32k.yaml", num_devices=None)
    sizes = {"data": 1, "fsdp": 2, "expert": 8, "context": 16, "tensor": 1}
    r = build_report(cfg, sizes, 256, 32768, micro_batches=16)["expert_all_to_all"]
    per_step = 6 * 60 * 16
    padded, ragged = r["strategies"]["padded"], r["strategies"]["ragged"]
    assert padded["row_bytes"] == 1_644_167_168 * per_step
    assert ragged["row_bytes"] == 205_520_896 * per_step
    assert padded["metadata_bytes"] == 114_688 * 4 * 2 * 60 * 16
    assert ragged["metadata_bytes"] == 7 * 384 * 4 * 2 * 60 * 16
    assert padded["row_bytes"] / ragged["row_bytes"] == 8
    assert r["link"] == "infiniband" and r["expert_axis_stride"] == 16
    assert ragged["seconds"]["infiniband"] == pytest.approx(ragged["bytes"] / 50e9)
    assert ragged["receive_rows"] == padded["receive_rows"] == 8 * 16_384  # capacity factor 0: worst case
    # EP inside a node (h200x256_ep8: fsdp 32 x expert 8, nothing after expert): NVLink
    inner = build_report(cfg, {"data": 1, "fsdp": 32, "expert": 8, "context": 1, "tensor": 1}, 256, 4096)
    assert inner["expert_all_to_all"]["link"] == "nvlink"
    # a capacity factor shrinks the ragged receive buffer, not the rows sent
    c2 = build_report(
        load_config(PRETRAIN / "stage1_32k.yaml", ["model.moe_ep_capacity_factor=2"], num_devices=None),
        sizes,
        256,
        32768,
        micro_batches=16,
    )["expert_all_to_all"]["strategies"]["ragged"]
    assert c2["receive_rows"] == 2 * 16_384 and c2["row_bytes"] == ragged["row_bytes"]
    assert main([str(PRETRAIN / "stage1_32k.yaml")]) == 0
    out = capsys.readouterr().out
    assert "expert all-to-all per device per step (EP 8" in out and "padded / ragged 8.00x" in out
