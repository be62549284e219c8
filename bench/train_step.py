"""One AdamW training step of the reference MoE on CPU: composer_jax next to Hugging Face transformers.

Model: the shared reference config (../shared/bench/moe_bench_config.json relative to the repository
root when present, else the same numbers embedded here): a 28.0M-parameter DeepSeek-V3-style MoE.
Workload: batch 8 x seq 512 (4096 tokens), float32, next-token loss, AdamW with global-norm
clipping (1.0), one optimiser step per iteration including the backward pass.

Both sides start from the same weights: the torch model is built first, written with
`save_pretrained` and read back with `composer_jax.from_pretrained` (routing, hence MoE cost,
depends on the weights). MTP is off on both sides (transformers has no MTP; the checkpoint holds no
MTP weights, so our model loads with num_mtp_layers=0). Both sides see the same batch.

Timing: after warm-up steps (compilation; first-step allocations) the two sides are run in
alternation, one step each per round, in the same process, and the median and minimum of the
rounds are reported (the machine is shared; alternation spreads the noise over both sides).
torch runs with torch.set_num_threads(<cores>); XLA:CPU uses its own thread pool over all cores.

FLOPs: composer_jax.model.accounting.flops_per_token (6 x active matmul params + causal attention),
the same count for both sides. MFU is against this machine's float32 matmul peak measured through
XLA (jax.jit of a 2048^3 matmul) in the same run.

Floor: the step's matrix products are read from its compiled HLO (bench/hlo_dots.py) and each is
timed alone, through XLA and as a torch.bmm. Their XLA sum is the time our step would take if
nothing but its matmuls cost anything, so "transformers median / that floor" is the largest ratio
this side can reach without faster matrix products or fewer FLOPs.

    PYTHONPATH=src .venv/bin/python bench/train_step.py [--repeats 5] [--hf-attn sdpa] [--hf-experts auto]

GPU (`--device gpu`, on a machine with one CUDA GPU and torch built for CUDA): the same model, batch
and optimiser, torch on "cuda" and JAX on its default GPU backend. Both sides multiply float32 in
full float32 by default (`--gpu-precision highest`: jax_default_matmul_precision="highest",
torch.backends.cuda.matmul.allow_tf32=False); `--gpu-precision tf32` lets both use TF32 tensor
cores. The peak is then a float32 8192^3 matmul through jax.jit at that precision, and our MoE uses
`moe_impl=auto` (ragged_dot on GPU) instead of the CPU's tiled dispatch.
"""

from __future__ import annotations

import os

# XLA:CPU flags, set here only (before jax is imported): see `--xla-flags`.
import sys

_DEFAULT_XLA_FLAGS = ""
if "--xla-flags" in sys.argv:
    _DEFAULT_XLA_FLAGS = sys.argv[sys.argv.index("--xla-flags") + 1]
if _DEFAULT_XLA_FLAGS:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _DEFAULT_XLA_FLAGS).strip()
# `--malloc-hugetlb`: glibc reads its tunables at process start, so the bench re-executes itself once
# with transparent huge pages for large allocations (both sides, since both run in this process).
_HUGETLB = "glibc.malloc.hugetlb=1"
if "--malloc-hugetlb" in sys.argv and _HUGETLB not in os.environ.get("GLIBC_TUNABLES", ""):
    _tun = ":".join(t for t in (os.environ.get("GLIBC_TUNABLES", ""), _HUGETLB) if t)
    os.execve(sys.executable, [sys.executable] + sys.argv, {**os.environ, "GLIBC_TUNABLES": _tun})

import argparse  # noqa: E402
import json  # noqa: E402
import resource  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

REFERENCE = Path(__file__).resolve().parents[1] / ".." / "shared" / "bench" / "moe_bench_config.json"
EMBEDDED = {
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 32000,
    "hidden_size": 256,
    "intermediate_size": 1024,
    "moe_intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "n_shared_experts": 1,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "first_k_dense_replace": 1,
    "norm_topk_prob": True,
    "q_lora_rank": 128,
    "kv_lora_rank": 64,
    "qk_nope_head_dim": 32,
    "qk_rope_head_dim": 16,
    "v_head_dim": 32,
    "max_position_embeddings": 4096,
    "rope_theta": 10000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 1,
    "torch_dtype": "float32",
}
BATCH, SEQ = 8, 512
LR, BETAS, WD, EPS, CLIP = 3e-4, (0.9, 0.95), 0.1, 1e-8, 1.0


def load_reference() -> tuple[dict, str]:
    if REFERENCE.exists():
        return json.loads(REFERENCE.read_text()), f"{REFERENCE.resolve()}"
    return dict(EMBEDDED), "embedded copy of the reference config (../shared/bench/moe_bench_config.json absent)"


# --------------------------------------------------------------------------------------------------
# The two sides
# --------------------------------------------------------------------------------------------------


def build_torch(fields: dict, attn: str, experts: str, seed: int, device: str = "cpu"):
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(seed)
    kwargs = {"attn_implementation": attn}
    if experts != "auto":
        kwargs["experts_implementation"] = experts
    model = DeepseekV3ForCausalLM._from_config(DeepseekV3Config(**fields), dtype=torch.float32, **kwargs)
    model.to(device)
    model.train()
    # the same decay mask as ours (train/optimizer.py): matrices except the embedding; no norms/biases
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed_tokens" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed_tokens" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}], lr=LR, betas=BETAS, eps=EPS
    )
    return model, opt


def torch_step_fn(model, opt, tokens_np: np.ndarray, device: str = "cpu"):
    import torch

    tokens = torch.from_numpy(tokens_np.astype(np.int64)).to(device)

    def step() -> float:
        # labels=input_ids: transformers shifts internally (position i predicts token i+1), as ours
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(loss.detach())  # a device-to-host copy: waits for the optimiser step too

    return step


def build_ours(hf_dir: str, overrides: list[str], moe_impl: str = "tiled"):
    from composer_jax.config import MeshConfig, config_from_dict, to_dict
    from composer_jax.hf.weights import from_pretrained
    from composer_jax.sharding import ShardingRules, make_mesh
    from composer_jax.train.state import init_train_state
    from composer_jax.train.step import make_train_step

    mesh = make_mesh(MeshConfig(data=1, fsdp=1, expert=1, context=1, tensor=1), devices=jax.devices()[:1])
    rules = ShardingRules.create()
    mcfg, params = from_pretrained(hf_dir, mesh, rules=rules)
    base = {"model": to_dict(mcfg), "mesh": {"data": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1}}
    fixed = [
        f"train.batch_size={BATCH}",
        f"train.seq_len={SEQ}",
        "train.mtp_weight=0",
        "train.z_loss=0",
        f"model.moe_impl={moe_impl}",
        "model.scan_layers=false",
        f"train.optimizer.lr={LR}",
        "train.optimizer.schedule=constant",
        "train.optimizer.warmup_steps=0",
        f"train.optimizer.b1={BETAS[0]}",
        f"train.optimizer.b2={BETAS[1]}",
        f"train.optimizer.weight_decay={WD}",
        f"train.optimizer.clip_norm={CLIP}",
        "train.steps=1000",
    ]
    given = {o.split("=", 1)[0].strip() for o in overrides}  # --override replaces the bench's own value
    cfg = config_from_dict(base, [o for o in fixed if o.split("=", 1)[0] not in given] + list(overrides), num_devices=1)
    state = init_train_state(cfg, mesh, rules, params=params)
    return cfg, mesh, rules, state, make_train_step(cfg, mesh, rules)


def jax_batch(tokens_np: np.ndarray) -> dict:
    b, s = tokens_np.shape
    return {
        "tokens": jnp.asarray(tokens_np, jnp.int32),
        "segment_ids": jnp.ones((b, s), jnp.int32),
        "positions": jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s)),
        "loss_mask": jnp.ones((b, s), jnp.float32),
    }


# --------------------------------------------------------------------------------------------------
# Peak and the matmul floor
# --------------------------------------------------------------------------------------------------


def peak_sampler(n: int = 2048):
    """-> sample(): FLOP/s of one float32 n^3 matmul through XLA (jax.jit; at jax's default matmul
    precision, which `--gpu-precision` sets on GPU). Sampled between the
    timed steps so that the peak sees the same machine load as the steps; the best sample is the
    peak (the most this machine delivered during the run)."""
    a = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(2), (n, n), jnp.float32)
    mm = jax.jit(jnp.matmul)
    jax.block_until_ready(mm(a, b))

    def sample() -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(mm(a, b))
        return 2 * n**3 / (time.perf_counter() - t0)

    return sample


def dot_floor(step, state, batch, peak: float, torch_device: str | None, top: int = 8) -> float | None:
    """Print the step's matrix products, read from its compiled HLO and each timed alone (bench/hlo_dots.py):
    their sum is the step's time if everything else were free and every product ran at the speed
    this backend gives it alone, a floor for our step; the same products through torch's matmul
    library show how much of the gap to transformers is the matmul library rather than the model."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from hlo_dots import dot_inventory, time_dots, time_dots_torch

    if jax.default_backend() != "cpu":
        print(
            f"\nno floor on {jax.default_backend()}: XLA:GPU lowers matrix products to cuBLAS custom calls and "
            "Triton fusions, which bench/hlo_dots.py does not count"
        )
        return None
    dots, notes = dot_inventory(step.lower(state, batch).compile().as_text())
    rows = time_dots(dots)
    ours = sum(c * t for _, c, t in rows)
    flops = sum(d.flops * c for d, c, _ in rows)
    theirs = time_dots_torch(dots, device=torch_device) if torch_device else None
    print(
        f"\nthe step's matrix products (from its compiled HLO: {len(rows)} distinct, {sum(dots.values())} executed, "
        f"{flops / 1e9:.0f} GFLOP incl. tile padding), each timed alone, best of 3:"
    )
    for note in notes:
        print(f"  note: {note}")
    print(
        f"  XLA:{jax.default_backend().upper()}: {ours:.3f} s ({flops / ours / 1e9:.0f} GFLOP/s, "
        f"{flops / ours / peak:.0%} of peak) <- floor for our step"
        + (f"; the same products in torch (bmm): {sum(c * theirs[d] for d, c, _ in rows):.3f} s" if theirs else "")
    )
    print(f"  the {top} costliest (count x time alone):")
    for d, c, t in rows[:top]:
        other = f"  torch {theirs[d] * 1e3:7.2f} ms" if theirs else ""
        print(f"  {c:3d} x {t * 1e3:7.2f} ms {d.flops / t / 1e9:6.0f} GFLOP/s{other}  {d}")
    return ours


# --------------------------------------------------------------------------------------------------


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=7, help="timed steps per side (alternating), >= 5")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps per side first (compile, allocations)")
    ap.add_argument("--hf-attn", default="sdpa", choices=["sdpa", "eager"])
    ap.add_argument("--hf-experts", default="auto", help="transformers experts_implementation (auto = its default)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch.set_num_threads")
    ap.add_argument("--override", action="append", default=[], help="extra composer_jax key=value (ours only)")
    ap.add_argument("--xla-flags", default="", help="XLA_FLAGS for this process only (set before jax starts)")
    ap.add_argument("--skip-hf", action="store_true", help="time our step only")
    ap.add_argument(
        "--malloc-hugetlb",
        action="store_true",
        help="run with GLIBC_TUNABLES=glibc.malloc.hugetlb=1 (re-executes the bench)",
    )
    ap.add_argument("--no-shapes", action="store_true", help="skip the matmul floor (the step's products timed alone)")
    ap.add_argument("--device", default="cpu", choices=["cpu", "gpu"], help="where both sides run (see the docstring)")
    ap.add_argument(
        "--gpu-precision",
        default="highest",
        choices=["highest", "tf32"],
        help="float32 matmul precision of both sides on GPU",
    )
    args = ap.parse_args()
    import torch

    gpu = args.device == "gpu"
    if gpu:
        if jax.default_backend() != "gpu" or not torch.cuda.is_available():
            raise SystemExit(
                f"--device gpu needs a CUDA GPU for both JAX (backend: {jax.default_backend()!r}) "
                f"and torch (cuda available: {torch.cuda.is_available()})"
            )
        jax.config.update(
            "jax_default_matmul_precision", "highest" if args.gpu_precision == "highest" else "tensorfloat32"
        )
        torch.backends.cuda.matmul.allow_tf32 = args.gpu_precision == "tf32"
    elif jax.default_backend() != "cpu":
        raise SystemExit(
            f"the CPU bench found JAX on {jax.default_backend()!r}: run it with JAX_PLATFORMS=cpu, or pass --device gpu"
        )
    torch.set_num_threads(args.threads)
    fields, source = load_reference()
    print(f"config: {source}")
    where = (
        f"GPU {torch.cuda.get_device_name()} / {jax.devices()[0].device_kind}, float32 matmuls at "
        f"'{args.gpu_precision}' precision on both sides"
        if gpu
        else f"torch with set_num_threads({args.threads})"
    )
    print(
        f"machine: {os.cpu_count()} cores; jax {jax.__version__} ({jax.default_backend()}); torch {torch.__version__}; "
        f"{where}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}; "
        f"GLIBC_TUNABLES={os.environ.get('GLIBC_TUNABLES', '')!r}"
    )

    rng = np.random.default_rng(0)
    tokens_np = rng.integers(0, fields["vocab_size"], (BATCH, SEQ), dtype=np.int64)

    tdev = "cuda" if gpu else "cpu"
    model, opt = build_torch(fields, args.hf_attn, args.hf_experts, seed=0, device=tdev)
    with tempfile.TemporaryDirectory() as d:
        model.save_pretrained(d)
        cfg, mesh, rules, state, step = build_ours(d, args.override, moe_impl="auto" if gpu else "tiled")
    hf_impl = f"attn={model.config._attn_implementation}, experts={model.config._experts_implementation}"

    from composer_jax.model.accounting import flops_per_token, param_rows

    rows = param_rows(cfg.model)
    fpt = flops_per_token(cfg.model, rows, SEQ)
    total_params = sum(r.size for r in rows)
    tokens = BATCH * SEQ
    step_flops = fpt["total"] * tokens
    print(
        f"model: {total_params / 1e6:.1f}M params (mtp layers: {cfg.model.num_mtp_layers}), "
        f"{fpt['matmul_active_params'] / 1e6:.2f}M active matmul params; {fpt['total'] / 1e6:.1f} MFLOP/token "
        f"(6N + causal attention) -> {step_flops / 1e12:.3f} TFLOP per step of {BATCH}x{SEQ} tokens"
    )
    print(
        f"ours: moe_impl={cfg.model.moe_impl} tile={cfg.model.moe_tile_size} remat={cfg.model.remat} "
        f"overrides={args.override}; transformers: {hf_impl}, train mode"
    )

    batch = jax_batch(tokens_np)
    holder = {"state": state}

    def ours() -> float:
        holder["state"], metrics = step(holder["state"], batch)
        return float(metrics["loss"])  # blocks until the step is done

    sides = {"composer_jax": ours}
    if not args.skip_hf:
        sides["transformers"] = torch_step_fn(model, opt, tokens_np, device=tdev)
    first_loss = {}
    for name, fn in sides.items():
        t0 = time.perf_counter()
        first_loss[name] = fn()
        print(f"{name}: first step {time.perf_counter() - t0:.1f} s (incl. compile), loss {first_loss[name]:.4f}")
        for _ in range(args.warmup - 1):
            fn()
    n_peak = 8192 if gpu else 2048
    sample_peak = peak_sampler(n_peak)
    peaks = [sample_peak() for _ in range(3)]
    times: dict[str, list[float]] = {k: [] for k in sides}
    faults: dict[str, list[tuple[int, float]]] = {k: [] for k in sides}  # (minor page faults, system CPU s)
    for _ in range(args.repeats):
        for name, fn in sides.items():
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            faults[name].append((r1.ru_minflt - r0.ru_minflt, r1.ru_stime - r0.ru_stime))
            peaks += [sample_peak() for _ in range(2)]
    peak = max(peaks)
    print(
        f"\nmeasured peak: {peak / 1e9:.0f} GFLOP/s (float32 {n_peak}^3 matmul via jax.jit: "
        f"best of {len(peaks)} samples "
        f"taken between the steps; median sample {statistics.median(peaks) / 1e9:.0f} GFLOP/s)"
    )
    print(f"load average during the run: {os.getloadavg()[0]:.1f} (1 min) on {os.cpu_count()} cores")
    print(f"timed: {args.repeats} alternating steps per side after {args.warmup} warm-up steps\n")
    hdr = f"{'side':<14} {'median s':>9} {'min s':>7} {'tokens/s':>9} {'TFLOP/s':>8} {'MFU':>6} {'ours/HF':>8}"
    print(hdr)
    print("-" * len(hdr))
    med = {k: statistics.median(v) for k, v in times.items()}
    for name, ts in times.items():
        m = med[name]
        ratio = med.get("transformers", float("nan")) / m
        print(
            f"{name:<14} {m:9.3f} {min(ts):7.3f} {tokens / m:9.0f} {step_flops / m / 1e12:8.3f} "
            f"{step_flops / m / peak:6.1%} {ratio:7.2f}x"
        )
    print(
        "(tokens/s, TFLOP/s and MFU from the median step; ours/HF = HF median / our median; MFU of the "
        "fastest step: " + ", ".join(f"{k} {step_flops / min(v) / peak:.1%}" for k, v in times.items()) + ")"
    )
    print("\nall step times (s): " + "; ".join(f"{k}: {', '.join(f'{t:.3f}' for t in v)}" for k, v in times.items()))
    print(
        "per step, whole process (median): "
        + "; ".join(
            f"{k}: {statistics.median(f for f, _ in v) / 1e3:.0f}K minor page faults, "
            f"{statistics.median(s for _, s in v):.2f} s system CPU time"
            for k, v in faults.items()
        )
        + " (temporaries allocated and first touched every step)"
    )
    if not args.no_shapes:
        floor = dot_floor(step, holder["state"], batch, peak, None if args.skip_hf else tdev)
        if floor and "transformers" in med:
            print(
                f"  transformers median step / our floor = {med['transformers'] / floor:.2f}x: the most this "
                f"side can be ahead without faster matrix products or fewer FLOPs"
            )


if __name__ == "__main__":
    main()
