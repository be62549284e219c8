"""`make gpu-check OUT=DIR`: one command that proves the GPU paths on one GPU (issue 42).

    python bench/gpu_check.py --out DIR [--sections kernels,train,decode,sharded] [--budget-s 480]
    python bench/gpu_check.py --out DIR --dry-run      # every section on CPU at tiny shapes

Writes DIR/gpu_check.json and DIR/gpu_check.md after every section (so a run cut short still leaves
what it measured) and exits 1 when a check failed or a section raised. Sections, in order:

- `env`: Python, JAX, jaxlib, the CUDA plugin, torch, transformers, Triton, the device, and which of
  the project's imports are missing (the device image has no grain; `carried wheels` in docs/gpu.md).
- `kernels`: each Pallas kernel against its jnp twin (quantisation bit for bit, matmuls within
  their tolerance), then TFLOP/s of bf16 `ragged_dot` and the MXFP8 / NVFP4 kernels on DeepSeek-V3
  and Kimi-K2 expert shapes, and the MoE layer forward + backward per recipe (bench/gpu_kernels.py).
- `train`: a training step of a ~1.7B-parameter MoE (MLA, 64 experts, top-8, `MODEL` below) on one
  device: step time and MFU (6N + attention FLOPs, model/accounting.py, against the dense bf16 peak)
  for the bf16 and MXFP8 (Pallas) recipes, and the device's peak memory beside `inspect`'s estimate.
- `decode`: our sampler's greedy decode tokens/s at batch 1, 16 and 64 on the same weights beside
  transformers' `generate` on the same GPU, and the share of greedy tokens that agree.
- `sharded`: the train step's loss and gradients on a mesh of one device with the expert and context
  code paths on (shard_map over size-1 axes) and on a 4-device host-CPU mesh (expert 2 x context 2:
  the padded exchange and context-parallel attention) against the unsharded step on the device.
  (The ragged all-to-all needs two GPUs: one device cannot exercise it.)

The model is made once by transformers (random weights, `MODEL`), written as safetensors, and read
by `from_pretrained`, so the train, decode and transformers sides hold the same weights.
`--dry-run` runs the same code at tiny shapes on CPU with the kernels interpreted; the default test
suite runs it (tests/bench/test_gpu_check.py), so device minutes go to measuring.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
SECTIONS = ("kernels", "train", "decode", "sharded")
BF16_DENSE_PEAK = {"H100": 989.0, "H200": 989.0}  # TFLOP/s, NVIDIA data sheets (half the "with sparsity" figure)
# the train and decode model: DeepSeek-V3's layout at ~1.7B parameters (~0.4B active per token)
MODEL = {
    "model_type": "deepseek_v3",
    "vocab_size": 32000,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "moe_intermediate_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_shared_experts": 1,
    "n_routed_experts": 64,
    "num_experts_per_tok": 8,
    "n_group": 1,
    "topk_group": 1,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "q_lora_rank": 768,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "max_position_embeddings": 8192,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0,
}
TINY_MODEL = MODEL | {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "max_position_embeddings": 256,
}


@dataclasses.dataclass
class Plan:
    """What one run measures: the shapes (full or --dry-run), where results go, the time left."""

    out: Path
    dry_run: bool
    deadline: float
    workdir: Path
    hf_dir: Path | None = None  # the transformers-made model, written once
    on_gpu: bool = False
    train: dict = dataclasses.field(default_factory=dict)
    decode: dict = dataclasses.field(default_factory=dict)

    @property
    def model(self) -> dict:
        return TINY_MODEL if self.dry_run else MODEL


def _gpu_peak() -> float | None:
    import jax

    kind = jax.devices()[0].device_kind
    return next((v for name, v in BF16_DENSE_PEAK.items() if name in kind), None)


# ------------------------------------------------------------------------------------------ sections
def section_env(plan: Plan) -> dict:
    import jax

    versions: dict[str, str | None] = {"python": platform.python_version()}
    for mod in ("jax", "jaxlib", "flax", "optax", "orbax.checkpoint", "chex", "einops", "tensorstore"):
        versions[mod] = _version(mod)
    for mod in ("torch", "transformers", "triton", "grain", "tensorboardX", "safetensors", "tokenizers"):
        versions[mod] = _version(mod)
    try:
        plugin = _version("jax_plugins.xla_cuda13") or _version("jax_cuda13_plugin")
    except Exception:  # noqa: BLE001 - only a version string
        plugin = None
    missing = [m for m in ("grain", "tensorboardX", "orbax.checkpoint", "tensorstore") if versions.get(m) is None]
    return {
        "checks": [],
        "versions": versions | {"cuda_plugin": plugin},
        "backend": jax.default_backend(),
        "devices": [d.device_kind for d in jax.devices()],
        "missing_imports": missing,
    }


def _version(mod: str) -> str | None:
    try:
        m = importlib.import_module(mod)
    except Exception:  # noqa: BLE001 - a missing or broken package is what this reports
        return None
    return str(getattr(m, "__version__", "present"))


def section_kernels(plan: Plan) -> dict:
    sys.path.insert(0, str(HERE))
    import gpu_kernels as gk

    if plan.dry_run:
        models, tokens, ep = {"small": gk.SMALL}, 32, 1
        opts = gk.Options(interpret=True, repeats=1, tm=32, tn=32)
        rows, groups = tokens * gk.SMALL["top_k"], gk.SMALL["experts"]
    else:
        models, tokens, ep = dict(gk.MODELS), 4096, 8
        opts = gk.Options(interpret=False, repeats=10, tm=64, tn=128)
        rows, groups = 2048, 8
    first = next(iter(models.values()))
    checks = gk.check_kernels(rows, first["hidden"], first["inter"], groups, opts)
    grouped: list[dict] = []
    layer: list[dict] = []
    kind = _device_kind()
    peak = next((v for name, v in gk.PEAKS.items() if name in kind), None)
    for name, shape in models.items():
        gk.bench_grouped(name, shape, tokens, opts, peak, records=grouped)
        checks += gk.bench_layer(name, shape, tokens, ep, opts, records=layer)
    return {"checks": checks, "grouped": grouped, "layer": layer}


def _device_kind() -> str:
    import jax

    return jax.devices()[0].device_kind


def _hf_model_dir(plan: Plan) -> Path:
    """The transformers-made model (random weights, fixed seed) as a Hugging Face checkpoint."""
    if plan.hf_dir is not None:
        return plan.hf_dir
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(plan.model)
    torch.manual_seed(0)
    dtype = torch.bfloat16  # the train section's dtype (the real configs'); decode reads the same weights
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    with torch.device("cuda" if plan.on_gpu and torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    plan.hf_dir = plan.workdir / "model"
    model.save_pretrained(plan.hf_dir)
    del model
    return plan.hf_dir


def _train_sides(plan: Plan) -> list[tuple[str, list[str]]]:
    # the dry run steps the MXFP8 recipe through the reference backend (the Pallas kernels
    # interpreted cost ~10 s; tests/quant/test_pallas_backend.py keeps them equal to it)
    backend = "xla" if plan.dry_run else "pallas"
    return [("bf16", []), ("mxfp8", ["model.moe_precision=mxfp8", f"model.moe_quant_backend={backend}"])]


def section_train(plan: Plan) -> dict:
    import jax

    sys.path.insert(0, str(HERE))
    import train_step as ts

    from composer_jax.inspection import build_report
    from composer_jax.model.accounting import flops_per_token, param_rows

    hf_dir = _hf_model_dir(plan)
    batch, seq, repeats = (2, 32, 1) if plan.dry_run else (8, 2048, 5)
    common = [
        f"train.batch_size={batch}",
        f"train.seq_len={seq}",
        "model.scan_layers=true",
        "model.compute_dtype=bfloat16",
        "model.param_dtype=bfloat16",  # the real configs' dtypes (configs/model/deepseek_v3.yaml)
    ]
    tokens_np = np.random.default_rng(0).integers(0, plan.model["vocab_size"], (batch, seq))
    peak = _gpu_peak()
    rows_out, checks = [], []
    for recipe, extra in _train_sides(plan):
        cfg, _, _, state, step = ts.build_ours(str(hf_dir), common + extra, moe_impl="auto")
        data = ts.jax_batch(tokens_np)
        t0 = time.perf_counter()
        state, metrics = step(state, data)
        first = float(metrics["loss"])
        compile_s = time.perf_counter() - t0
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            state, metrics = step(state, data)
            float(metrics["loss"])
            times.append(time.perf_counter() - t0)
        rows = param_rows(cfg.model)
        step_flops = flops_per_token(cfg.model, rows, seq)["total"] * batch * seq
        t = float(np.median(times))
        stats = jax.devices()[0].memory_stats() or {}
        sizes = {a: 1 for a in ("data", "fsdp", "expert", "context", "tensor")}
        estimate = build_report(cfg, sizes, batch, seq, backend=jax.default_backend())["memory_per_device"]["total"]
        rows_out.append(
            {
                "recipe": recipe,
                "params": sum(r.size for r in rows),
                "batch": batch,
                "seq": seq,
                "first_step_s": compile_s,
                "step_s": t,
                "tflops": step_flops / t / 1e12,
                "mfu": step_flops / t / (peak * 1e12) if peak else None,
                "peak_bytes": stats.get("peak_bytes_in_use"),
                "inspect_estimate_bytes": estimate,
                "loss_first": first,
                "loss_last": float(metrics["loss"]),
            }
        )
        checks.append((f"train step {recipe}: finite loss", bool(np.isfinite(float(metrics["loss"]))), f"{first:.3f}"))
        del state, step
    return {"checks": checks, "steps": rows_out}


def section_decode(plan: Plan) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from composer_jax.hf.weights import from_pretrained
    from composer_jax.inference.engine.batch_sampler import Request, Sampler, SamplerSettings
    from composer_jax.inference.engine.token_sampling import SamplingParams

    hf_dir = _hf_model_dir(plan)
    device = "cuda" if plan.on_gpu and torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16
    theirs_model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=dtype)
    theirs_model.to(device)  # type: ignore[arg-type]  # transformers' decorated `to` types its self oddly
    theirs_model.eval()
    cfg, params = from_pretrained(str(hf_dir))
    batches, prompt, new, repeats = ((2,), 8, 4, 1) if plan.dry_run else ((1, 16, 64), 32, 64, 3)
    greedy = SamplingParams(temperature=0.0, max_tokens=new)
    rows, checks = [], []
    for b in batches:
        prompts = np.random.default_rng(b).integers(0, cfg.vocab_size, (b, prompt))
        sampler = Sampler(params, cfg, SamplerSettings(slots=b, max_len=prompt + new, decode_chunk=16))

        def ours(sampler: Sampler = sampler, prompts: np.ndarray = prompts) -> np.ndarray:
            return np.asarray([c.tokens for c in sampler.run([Request(list(map(int, p)), greedy) for p in prompts])])

        def theirs(prompts: np.ndarray = prompts) -> np.ndarray:
            ids = torch.from_numpy(prompts).to(device)
            with torch.no_grad():
                out = theirs_model.generate(
                    ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, attention_mask=torch.ones_like(ids)
                )
            if device == "cuda":
                torch.cuda.synchronize()
            return out[:, prompt:].cpu().numpy()

        got = {"ours": ours(), "theirs": theirs()}  # warm-up: compilation, first-call setup
        wall: dict[str, list[float]] = {"ours": [], "theirs": []}
        for _ in range(repeats):
            for name, fn in (("ours", ours), ("theirs", theirs)):
                t0 = time.perf_counter()
                fn()
                wall[name].append(time.perf_counter() - t0)
        med = {k: float(np.median(v)) for k, v in wall.items()}
        agree = float((got["ours"] == got["theirs"]).mean())
        rows.append(
            {
                "batch": b,
                "ours_tok_s": b * new / med["ours"],
                "transformers_tok_s": b * new / med["theirs"],
                "ratio": med["theirs"] / med["ours"],
                "greedy_agreement": agree,
            }
        )
        shape = got["ours"].shape
        checks.append((f"decode batch {b}: {new} tokens per row", shape == (b, new), str(shape)))
    return {"checks": checks, "batches": rows, "dtype": str(dtype)}


def section_sharded(plan: Plan) -> dict:
    """Loss and gradients of the tiny model's step: unsharded on the device, then on a one-device
    mesh (shard_map over size-1 expert and context axes) and on 4 host CPUs (expert 2 x context 2)."""
    import jax

    import composer_jax as cj
    from composer_jax.sharding import MeshRules, ShardingRules
    from composer_jax.train.step import batch_gradients

    tiny = HERE.parent / "configs/model/tiny.yaml"
    b, s = 4, 64
    overrides = [f"train.batch_size={b}", f"train.seq_len={s}", "model.moe_impl=auto"]
    rng = np.random.default_rng(0)
    batch = {
        "tokens": rng.integers(1, 512, (b, s)).astype(np.int32),
        "segment_ids": np.ones((b, s), np.int32),
        "positions": np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)).copy(),
        "loss_mask": np.ones((b, s), np.float32),
    }
    cpus = jax.devices("cpu")
    checks: list[tuple[str, bool, str]] = []
    with jax.default_matmul_precision("highest"):
        cfg = cj.load_config(tiny, overrides, num_devices=1)
        params = cj.init_params(cfg.model, jax.random.key(0))
        ref_obj, ref_grads, _, _ = jax.jit(lambda p, b: batch_gradients(p, b, cfg))(params, batch)
        meshes = {}
        if plan.on_gpu:  # on CPU this is the unsharded step's own backend: tests/train keep it
            meshes["device mesh 1x1 (expert, context paths)"] = (dict(expert=1, context=1), jax.devices()[:1])
        if len(cpus) >= 4:
            meshes["host cpu mesh expert2 x context2"] = (dict(expert=2, context=2), cpus[:4])
        for name, (axes, devices) in meshes.items():
            mesh_cfg = cj.MeshConfig(**{"data": 1, "fsdp": 1, "tensor": 1, **axes})
            cfg_m = cj.load_config(tiny, overrides, num_devices=len(devices))
            mesh = cj.make_mesh(mesh_cfg, devices=devices)
            rules = ShardingRules.create()
            sharded = cj.init_params(cfg_m.model, jax.random.key(0), mesh, rules)
            with jax.set_mesh(mesh):
                step = functools.partial(batch_gradients, cfg=cfg_m, sharding=MeshRules(mesh, rules))
                obj, grads, _, _ = jax.jit(step)(sharded, batch)
            err = _max_rel(grads, ref_grads)
            d_obj = abs(float(obj) - float(ref_obj)) / max(abs(float(ref_obj)), 1e-30)
            ok = d_obj <= 1e-4 and err <= 1e-3
            checks.append((f"sharded == unsharded: {name}", ok, f"objective rel {d_obj:.1e}, grads max rel {err:.1e}"))
    return {"checks": checks}


def _max_rel(a: Any, b: Any) -> float:
    import jax

    worst = 0.0
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
        worst = max(worst, float(np.abs(x - y).max() / max(np.abs(y).max(), 1e-12)))
    return worst


RUNNERS: dict[str, Callable[[Plan], dict]] = {
    "kernels": section_kernels,
    "train": section_train,
    "decode": section_decode,
    "sharded": section_sharded,
}


# ------------------------------------------------------------------------------------------ report
def write_report(out: Path, results: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_check.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / "gpu_check.md").write_text(markdown(results))


def markdown(results: dict) -> str:
    lines = [f"# gpu-check ({'dry run, CPU' if results['dry_run'] else 'device'})", ""]
    env = results["sections"].get("env", {})
    if env:
        versions = ", ".join(f"{k} {v}" for k, v in env.get("versions", {}).items() if v)
        lines += [f"- device: {', '.join(env.get('devices', []))} ({env.get('backend')})", f"- versions: {versions}"]
        lines += [f"- missing imports: {env.get('missing_imports') or 'none'}", ""]
    lines += ["| section | status | seconds | checks passed |", "| --- | --- | --- | --- |"]
    for name, sec in results["sections"].items():
        checks = sec.get("checks", [])
        ok = sum(1 for c in checks if c[1])
        lines.append(f"| {name} | {sec.get('status')} | {sec.get('seconds', 0):.1f} | {ok}/{len(checks)} |")
    for name, sec in results["sections"].items():
        failed = [c for c in sec.get("checks", []) if not c[1]]
        for c in failed:
            lines.append(f"\nFAIL {name}: {c[0]}: {c[2]}")
        if sec.get("error"):
            lines.append(f"\n{name} raised:\n\n```\n{sec['error'][-2000:]}\n```")
    lines += _tables(results["sections"])
    return "\n".join(lines) + "\n"


def _tables(sections: dict) -> list[str]:
    out: list[str] = []
    for title, rows in (
        ("Grouped matmuls", sections.get("kernels", {}).get("grouped", [])),
        ("MoE layer forward + backward", sections.get("kernels", {}).get("layer", [])),
        ("Train step", sections.get("train", {}).get("steps", [])),
        ("Decode", sections.get("decode", {}).get("batches", [])),
    ):
        if not rows:
            continue
        cols = list(rows[0])
        out += ["", f"## {title}", "", "| " + " | ".join(cols) + " |", "|" + " --- |" * len(cols)]
        out += ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in rows]
    return out


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


# ------------------------------------------------------------------------------------------ main
def run(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True, help="folder for gpu_check.json and gpu_check.md")
    ap.add_argument("--dry-run", action="store_true", help="every section on CPU at tiny shapes")
    ap.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated from {', '.join(SECTIONS)}")
    ap.add_argument("--budget-s", type=float, default=480.0, help="sections not started by then are skipped")
    args = ap.parse_args(argv)
    wanted = [s for s in args.sections.split(",") if s]
    if bad := [s for s in wanted if s not in SECTIONS]:
        ap.error(f"--sections: {bad} not accepted; accepted: {', '.join(SECTIONS)}")
    import jax

    on_gpu = jax.default_backend() in ("gpu", "cuda")
    if not on_gpu and not args.dry_run:
        ap.error(f"no GPU (JAX backend {jax.default_backend()!r}): run with --dry-run on CPU")
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as work:
        plan = Plan(args.out, args.dry_run, time.monotonic() + args.budget_s, Path(work), on_gpu=on_gpu)
        results: dict[str, Any] = {"dry_run": args.dry_run, "argv": list(argv or sys.argv[1:]), "sections": {}}
        for name, fn in [("env", section_env), *((s, RUNNERS[s]) for s in wanted)]:
            results["sections"][name] = _run_section(plan, fn)
            write_report(args.out, results)
    return results


def _run_section(plan: Plan, fn: Callable[[Plan], dict]) -> dict:
    if time.monotonic() > plan.deadline:
        return {"status": "skipped (budget)", "checks": []}
    t0 = time.perf_counter()
    try:
        sec = fn(plan)
        sec["status"] = "ok" if all(c[1] for c in sec.get("checks", [])) else "failed checks"
    except Exception:  # noqa: BLE001 - a section's failure is recorded; the next section still runs
        sec = {"status": "raised", "checks": [], "error": traceback.format_exc()}
    sec["seconds"] = time.perf_counter() - t0
    return sec


def main(argv: Sequence[str] | None = None) -> int:
    results = run(argv)
    print(markdown(results))
    return 0 if all(s.get("status") in ("ok",) for s in results["sections"].values()) else 1


if __name__ == "__main__":
    if "--dry-run" in sys.argv:
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    jax.config.update("jax_num_cpu_devices", 4)  # the sharded section's host mesh (before any backend starts)
    sys.exit(main())
