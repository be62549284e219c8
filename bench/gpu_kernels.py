"""The Pallas GPU kernels of `pallas_kernels/`: each checked against its jnp twin, then timed.

On a GPU (H100 / H200):

    python bench/gpu_kernels.py [--models deepseek_v3,kimi_k2] [--tokens 4096] [--ep 8] [--repeats 10]

prints, per model's expert shapes (DeepSeek-V3: hidden 7168, moe_intermediate 2048, 256 experts,
top-8; Kimi K2: the same with 384 experts) and per projection (up/gate: K=7168 -> N=2048; down:
K=2048 -> N=7168), the TFLOP/s of the bf16 grouped matmul (`jax.lax.ragged_dot`), the MXFP8 and NVFP4
forward kernels and the MXFP8 dgrad / wgrad kernels beside bf16's, their ratio to bf16 and their
share of the FP8 dense peak; then the MoE layer forward+backward per recipe and backend on the
experts one device holds under expert parallelism (experts / ep), `tokens` tokens per device.
Operands of the timed matmuls are quantised beforehand (the kernels alone); the MoE layer times
include the quantisation.

On CPU, to show that the script and the kernels work (correctness only, no speed):

    python bench/gpu_kernels.py --interpret --small

Peaks (dense, without sparsity; NVIDIA's H100 SXM / H200 datasheets list FP8 3,958 and BF16 1,979
TFLOP/s "with sparsity", half that dense): FP8 1979, BF16 989 TFLOP/s. Targets (issue 15): MXFP8
grouped matmul >= 1.3x the bf16 one and >= 50% of FP8 dense peak.

`--lowering` reports what this machine's JAX lowers for CUDA (no GPU needed): a Triton FP8 dot and
a Mosaic GPU FP8 wgmma with each B-operand layout (docs/architecture.md, "Triton or Mosaic GPU").
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from composer_jax.config import ModelConfig
from composer_jax.model.moe import layer
from pallas_kernels import grouped_matmul as gm
from pallas_kernels import grouped_matmul_bwd as gmb
from pallas_kernels import mx_quant, nvfp4_quant

MODELS = {
    "deepseek_v3": dict(hidden=7168, inter=2048, experts=256, top_k=8, n_group=8, topk_group=4),
    "kimi_k2": dict(hidden=7168, inter=2048, experts=384, top_k=8, n_group=1, topk_group=1),
}
SMALL = dict(hidden=64, inter=32, experts=8, top_k=2, n_group=1, topk_group=1)
PEAKS = {"H100": (1979.0, 989.0), "H200": (1979.0, 989.0)}  # dense FP8, BF16 TFLOP/s
LAYER_RECIPES = [
    ("bf16", "xla"),
    ("mxfp8", "xla"),
    ("mxfp8", "pallas"),
    ("nvfp4_fwd_mxfp8_bwd", "xla"),
    ("nvfp4_fwd_mxfp8_bwd", "pallas"),
]


@dataclasses.dataclass
class Options:
    interpret: bool
    repeats: int
    tm: int
    tn: int


def routed_sizes(rows: int, experts: int, seed: int = 0) -> jax.Array:
    """Group sizes of `rows` assignments over experts, imbalanced like a router's (log-normal
    popularity) with one expert in 16 receiving none."""
    rng = np.random.default_rng(seed)
    p = np.exp(rng.normal(scale=0.7, size=experts))
    p[rng.permutation(experts)[: max(1, experts // 16)]] = 0.0
    return jnp.asarray(rng.multinomial(rows, p / p.sum()).astype(np.int32))


def timed(fn: Callable, *args, repeats: int) -> float:
    """Median seconds of fn(*args) after one warm-up call (compilation)."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def rel_err(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)) if b.size else 0.0


def _bits_equal(a, b) -> bool:
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and bool(np.all(a.view(np.uint8) == b.view(np.uint8)))


def _operands(rows: int, k: int, n: int, groups: int, seed: int):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(rows, k)).astype(np.float32))
    w = jnp.asarray((rng.normal(size=(groups, k, n)) / np.sqrt(k)).astype(np.float32))
    dy = jnp.asarray(rng.normal(size=(rows, n)).astype(np.float32))
    return x, w, dy


def quantised(x, w, dy, sizes, interpret: bool):
    """Every kernel's operands, quantised by the Pallas quantisation kernels."""
    g, k, n = w.shape
    q: dict[str, tuple] = {}
    q["x_mx"] = mx_quant.mxfp8_quantize(x, 1, tile=32, interpret=interpret)
    wv, ws = mx_quant.mxfp8_quantize(w.reshape(g * k, n), 0, tile=32, interpret=interpret)
    q["w_mx_k"] = (wv.reshape(g, k, n), ws.reshape(g, k // 32, n))
    xp, xsb, xs2 = nvfp4_quant.nvfp4_quantize(x, tile=32, interpret=interpret)
    s2 = nvfp4_quant.second_scale(w.reshape(g, -1))
    wt = jnp.swapaxes(w, 1, 2).reshape(g * n, k)
    wp, wsb, _ = nvfp4_quant.nvfp4_quantize(wt, jnp.repeat(s2, n, axis=0), tile=32, interpret=interpret)
    q["x_nv"] = (xp, xsb, xs2)
    q["w_nv"] = (
        jnp.swapaxes(wp.reshape(g, n, k // 2), 1, 2),
        jnp.swapaxes(wsb.reshape(g, n, k // 16), 1, 2),
        s2.reshape(g),
    )
    q["dy_mx"] = mx_quant.mxfp8_quantize(dy, 1, tile=32, interpret=interpret)
    wv, ws = mx_quant.mxfp8_quantize(w.reshape(g * k, n), 1, tile=32, interpret=interpret)
    q["w_mx_n"] = (wv.reshape(g, k, n), ws.reshape(g, k, n // 32))
    q["x_mx_rows"] = mx_quant.mxfp8_quantize(gmb.to_group_padded(x, sizes), 0, tile=32, interpret=interpret)
    q["dy_mx_rows"] = mx_quant.mxfp8_quantize(gmb.to_group_padded(dy, sizes), 0, tile=32, interpret=interpret)
    return q


def check_kernels(rows: int, k: int, n: int, groups: int, opts: Options) -> list[tuple[str, bool, str]]:
    """Every kernel against its twin on ragged sizes with empty groups: quantisation bit for bit,
    matmuls within float32 accumulation tolerance (1e-5 of the largest output in the interpreter;
    2e-3 on a GPU, whose FP8 MMA accumulates partial products at reduced precision)."""
    x, w, dy = _operands(rows, k, n, groups, seed=1)
    sizes = routed_sizes(rows - rows // 8, groups, seed=1)  # rows past the groups too
    ip = opts.interpret
    tol = 1e-5 if ip else 2e-3
    out = []
    for axis in (1, 0):
        v, s = mx_quant.mxfp8_quantize(x, axis, interpret=ip)
        rv, rs = mx_quant.mxfp8_quantize_ref(x, axis)
        out.append((f"mxfp8_quantize axis={axis}", _bits_equal(v, rv) and _bits_equal(s, rs), "bit-exact"))
    got, ref = nvfp4_quant.nvfp4_quantize(x, interpret=ip), nvfp4_quant.nvfp4_quantize_ref(x)
    out.append(("nvfp4_quantize per token", all(_bits_equal(a, b) for a, b in zip(got, ref)), "bit-exact"))
    q = quantised(x, w, dy, sizes, ip)
    kw = dict(tm=opts.tm, interpret=ip)
    cases: list[tuple[str, Callable, tuple, dict]] = [
        ("grouped_matmul_mxfp8", gm.grouped_matmul_mxfp8, (*q["x_mx"], *q["w_mx_k"], sizes), dict(tn=opts.tn)),
        ("grouped_matmul_nvfp4", gm.grouped_matmul_nvfp4, (*q["x_nv"], *q["w_nv"], sizes), dict(tn=opts.tn)),
        ("grouped_matmul_mxfp8_dgrad", gmb.grouped_matmul_mxfp8_dgrad, (*q["dy_mx"], *q["w_mx_n"], sizes), {}),
    ]
    refs: dict[str, Callable] = {
        "grouped_matmul_mxfp8": gm.grouped_matmul_mxfp8_ref,
        "grouped_matmul_nvfp4": gm.grouped_matmul_nvfp4_ref,
        "grouped_matmul_mxfp8_dgrad": gmb.grouped_matmul_mxfp8_dgrad_ref,
    }
    for name, fn, args, extra in cases:
        e = rel_err(fn(*args, **kw, **extra), refs[name](*args))
        out.append((name, e <= tol, f"max err {e:.1e} of max |ref|"))
    args = (*q["x_mx_rows"], *q["dy_mx_rows"], sizes)
    e = rel_err(gmb.grouped_matmul_mxfp8_wgrad(*args, interpret=ip), gmb.grouped_matmul_mxfp8_wgrad_ref(*args))
    out.append(("grouped_matmul_mxfp8_wgrad", e <= tol, f"max err {e:.1e} of max |ref|"))
    return out


def bench_grouped(
    model: str, shape: dict, tokens: int, opts: Options, peak: tuple[float, float] | None, records: list | None = None
) -> None:
    """Per projection: bf16 ragged_dot forward / dgrad / wgrad beside the Pallas kernels (each
    timing also appended to `records` as a dict, for bench/gpu_check.py)."""
    rows = tokens * shape["top_k"]
    g = shape["experts"]
    sizes = routed_sizes(rows, g)
    for proj, k, n in (("gate/up", shape["hidden"], shape["inter"]), ("down", shape["inter"], shape["hidden"])):
        x, w, dy = _operands(rows, k, n, g, seed=2)
        q = quantised(x, w, dy, sizes, opts.interpret)
        xb, wb, dyb = (a.astype(jnp.bfloat16) for a in (x, w, dy))
        ragged = jax.jit(lambda a, b, s: jax.lax.ragged_dot(a, b, s, preferred_element_type=jnp.float32))
        ragged_t = jax.jit(
            lambda a, b, s: jax.lax.ragged_dot(a, jnp.swapaxes(b, 1, 2), s, preferred_element_type=jnp.float32)
        )

        @jax.jit
        def ragged_wgrad(a, d, s, w0):
            _, vjp = jax.vjp(lambda w_: jax.lax.ragged_dot(a, w_, s, preferred_element_type=jnp.float32), w0)
            return vjp(d.astype(jnp.float32))[0]

        # the kernels are jitted functions already: partials of them reuse their compilations
        kw = dict(tm=opts.tm, interpret=opts.interpret)
        runs: dict[tuple[str, str], tuple[Callable, tuple]] = {
            ("fwd", "bf16"): (ragged, (xb, wb, sizes)),
            ("fwd", "mxfp8"): (
                functools.partial(gm.grouped_matmul_mxfp8, tn=opts.tn, **kw),
                (*q["x_mx"], *q["w_mx_k"], sizes),
            ),
            ("fwd", "nvfp4"): (
                functools.partial(gm.grouped_matmul_nvfp4, tn=opts.tn, **kw),
                (*q["x_nv"], *q["w_nv"], sizes),
            ),
            ("dgrad", "bf16"): (ragged_t, (dyb, wb, sizes)),
            ("dgrad", "mxfp8"): (
                functools.partial(gmb.grouped_matmul_mxfp8_dgrad, tk=opts.tn, **kw),
                (*q["dy_mx"], *q["w_mx_n"], sizes),
            ),
            ("wgrad", "bf16"): (ragged_wgrad, (xb, dyb, sizes, wb)),
            ("wgrad", "mxfp8"): (
                functools.partial(gmb.grouped_matmul_mxfp8_wgrad, tk=opts.tn, tn=opts.tn, interpret=opts.interpret),
                (*q["x_mx_rows"], *q["dy_mx_rows"], sizes),
            ),
        }
        flops = 2.0 * float(sizes.sum()) * k * n
        base: dict[str, float] = {}
        for (op, fmt), (fn, args) in runs.items():
            if opts.interpret:  # the interpreter: run once, no speed
                jax.block_until_ready(fn(*args))
                print(f"{model:12s} {proj:8s} {op:6s} {fmt:6s} ran (interpret mode: no timing)")
                continue
            t = timed(fn, *args, repeats=opts.repeats)
            tflops = flops / t / 1e12
            if fmt == "bf16":
                base[op] = t
            ratio = f"{base[op] / t:5.2f}x bf16" if op in base and fmt != "bf16" else " " * 10
            pk = ""
            if peak is not None:
                name, value = ("BF16", peak[1]) if fmt == "bf16" else ("FP8", peak[0])
                pk = f"{100 * tflops / value:5.1f}% of {name} dense peak"
            print(f"{model:12s} {proj:8s} {op:6s} {fmt:6s} {t * 1e3:9.3f} ms {tflops:8.1f} TFLOP/s {ratio} {pk}")
            if records is not None:
                records.append(
                    {
                        "model": model,
                        "proj": proj,
                        "op": op,
                        "format": fmt,
                        "ms": t * 1e3,
                        "tflops": tflops,
                        "vs_bf16": base[op] / t if op in base and fmt != "bf16" else None,
                        "peak_share": (tflops / (peak[1] if fmt == "bf16" else peak[0])) if peak else None,
                    }
                )


def _layer_params(cfg: ModelConfig, key: jax.Array) -> dict:
    d, e, f = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    shapes = {"router": (d, e), "router_bias": (e,), "gate": (e, d, f), "up": (e, d, f), "down": (e, f, d)}
    shapes.update(shared_gate=(d, f), shared_up=(d, f), shared_down=(f, d))
    keys = jax.random.split(key, len(shapes))
    return {
        name: jax.random.normal(k, s, jnp.float32) / np.sqrt(s[-2] if len(s) > 1 else 1)
        for k, (name, s) in zip(keys, shapes.items())
    }


def _layer_config(shape: dict, experts: int, dtype: str) -> ModelConfig:
    n_group, topk_group = shape["n_group"], shape["topk_group"]
    if experts % n_group or experts // n_group * topk_group < shape["top_k"]:
        n_group = topk_group = 1
    return ModelConfig(
        hidden_size=shape["hidden"],
        moe_intermediate_size=shape["inter"],
        num_experts=experts,
        num_experts_per_tok=shape["top_k"],
        num_shared_experts=1,
        n_group=n_group,
        topk_group=topk_group,
        topk_method="noaux_tc",
        moe_impl="ragged",
        compute_dtype=dtype,  # type: ignore[arg-type]  # "float32" | "bfloat16", from the callers
        param_dtype=dtype,  # type: ignore[arg-type]
    )


def _layer_step(base: ModelConfig, precision: str, backend: str, c: jax.Array) -> Callable:
    overrides: dict[str, Any] = {"moe_precision": precision, "moe_quant_backend": backend}
    cfg = dataclasses.replace(base, **overrides)

    def loss(p, x):
        y = layer.moe_layer(p, x, cfg, None)[0]
        return jnp.sum(y.astype(jnp.float32) * c), y

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))


def _rel_norm(a, b) -> float:
    a, b = (jnp.asarray(v, jnp.float32) for v in (a, b))
    return float(jnp.linalg.norm(a - b)) / max(float(jnp.linalg.norm(b)), 1e-30)


def bench_layer(
    model: str, shape: dict, tokens: int, ep: int, opts: Options, records: list | None = None
) -> list[tuple[str, bool, str]]:
    """The MoE layer (router, routed experts, one shared expert) forward+backward per recipe and
    backend on experts / ep local experts, timed in bfloat16; each pallas backend checked against
    the xla one in float32 (in bfloat16 XLA may keep excess precision between fused operations,
    which moves values across quantisation boundaries differently in the two graphs)."""
    e = max(shape["experts"] // ep, shape["top_k"])
    checks = []
    check_tokens = min(tokens, 256)
    f32 = _layer_config(shape, e, "float32")
    p = _layer_params(f32, jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (1, check_tokens, shape["hidden"]), jnp.float32)
    c = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)
    # interpreter: the same float32 products, summed in the same order -> equal to rounding;
    # GPU: the xla backend's float32 matmuls may run as TF32 and the FP8 MMA accumulates at reduced
    # precision, and a value moved across a rounding boundary before the next quantisation moves by
    # one quantum (~6% of an element): a looser bound
    tol = 1e-3 if opts.interpret else 5e-2
    for precision in ("mxfp8", "nvfp4_fwd_mxfp8_bwd"):
        (_, ry), rg = _layer_step(f32, precision, "xla", c)(p, x)
        (_, y), g = _layer_step(f32, precision, "pallas", c)(p, x)
        err = max([_rel_norm(y, ry)] + [_rel_norm(a, b) for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(rg))])
        checks.append((f"moe layer {precision} pallas == xla", err <= tol, f"max rel norm err {err:.1e} (y, grads)"))
    if opts.interpret:
        print(f"{model:12s} layer: interpret mode, checks only (no timing)")
        return checks
    bf16 = _layer_config(shape, e, "bfloat16")
    p = jax.tree.map(lambda a: a.astype(jnp.bfloat16), _layer_params(bf16, jax.random.key(0)))
    x = jax.random.normal(jax.random.key(1), (1, tokens, shape["hidden"]), jnp.float32).astype(jnp.bfloat16)
    c = jax.random.normal(jax.random.key(2), x.shape, jnp.float32)
    flops = 3 * 3 * 2.0 * tokens * shape["top_k"] * shape["hidden"] * shape["inter"]  # 3 matmuls x (fwd, dgrad, wgrad)
    for precision, backend in LAYER_RECIPES:
        t = timed(_layer_step(bf16, precision, backend, c), p, x, repeats=opts.repeats)
        label = f"{model:12s} layer {e} experts x {tokens} tokens  {precision:20s} {backend:6s}"
        print(f"{label} {t * 1e3:9.2f} ms  {flops / t / 1e12:7.1f} routed-expert TFLOP/s")
        if records is not None:
            records.append(
                {"model": model, "experts": e, "tokens": tokens, "recipe": precision, "backend": backend}
                | {"ms": t * 1e3, "tflops": flops / t / 1e12}
            )
    return checks


def lowering_report() -> list[tuple[str, bool, str]]:
    """Which Pallas GPU backends lower an FP8 MMA for CUDA with this JAX (no GPU needed)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu
    from jax.experimental.pallas import triton as plt

    out = []
    f8 = jnp.float8_e4m3fn
    m, n, k = 64, 128, 128

    def triton_dot(a_ref, b_ref, o_ref):
        o_ref[...] = jnp.dot(a_ref[...], b_ref[...], preferred_element_type=jnp.float32)

    def lower(fn, *shapes) -> tuple[bool, str]:
        try:
            text = jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()
        except Exception as exc:  # the lowering's own refusal is the finding
            return False, f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        target = (
            "__gpu$xla.gpu.triton" if "__gpu$xla.gpu.triton" in text else "mosaic_gpu" if "mosaic_gpu" in text else "?"
        )
        return True, f"custom call {target}"

    tri = pl.pallas_call(
        triton_dot,
        out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
        compiler_params=plt.CompilerParams(num_warps=4, num_stages=1),
    )
    ok, what = lower(tri, jax.ShapeDtypeStruct((m, k), f8), jax.ShapeDtypeStruct((k, n), f8))
    out.append(("triton: fp8 x fp8 dot, f32 accumulate", ok, what))
    for b_kmajor in (False, True):
        tr = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))

        def body(a_ref, b_ref, o_ref, acc_ref, b_kmajor=b_kmajor):
            plgpu.wgmma(acc_ref, a_ref, plgpu.transpose_ref(b_ref, (1, 0)) if b_kmajor else b_ref)
            plgpu.wgmma_wait(0)
            o_ref[...] = acc_ref[...]

        mg = pl.pallas_call(
            body,
            in_specs=[plgpu.BlockSpec(transforms=tr), plgpu.BlockSpec(transforms=tr)],
            out_shape=jax.ShapeDtypeStruct((m, n), jnp.float32),
            scratch_shapes=[plgpu.ACC((m, n), jnp.float32)],  # type: ignore[list-item]  # ACC is one
        )
        b = jax.ShapeDtypeStruct((n, k) if b_kmajor else (k, n), f8)
        ok, what = lower(mg, jax.ShapeDtypeStruct((m, k), f8), b)
        layout = "B K-major ([N, K] in memory)" if b_kmajor else "B N-major ([K, N] in memory)"
        out.append((f"mosaic gpu: fp8 wgmma, {layout}", ok, what))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="deepseek_v3,kimi_k2", help=f"comma-separated from {sorted(MODELS)}")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per device (rows = tokens x top-k)")
    ap.add_argument("--ep", type=int, default=8, help="expert-parallel degree for the layer benchmark")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--tm", type=int, default=64, help="rows per grouped-matmul tile")
    ap.add_argument("--tn", type=int, default=128, help="output columns per tile")
    ap.add_argument("--interpret", action="store_true", help="run the kernels in the Pallas interpreter (CPU)")
    ap.add_argument("--small", action="store_true", help="tiny shapes: correctness only")
    ap.add_argument("--lowering", action="store_true", help="only report which FP8 MMA lowerings work")
    args = ap.parse_args(argv)
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        ap.error(f"--models: {unknown} not accepted; accepted: {', '.join(sorted(MODELS))}")
    checks: list[tuple[str, bool, str]] = []
    if args.lowering:
        checks = lowering_report()
        for name, ok, detail in checks:
            print(f"{'LOWERS' if ok else 'FAILS':6s} {name} | {detail}")
        return 0
    on_gpu = jax.default_backend() in ("gpu", "cuda")
    if not on_gpu and not args.interpret:
        ap.error(f"no GPU (backend {jax.default_backend()!r}): run with --interpret --small for a correctness run")
    if args.small:
        models = {"small": SMALL}
        opts = Options(interpret=args.interpret, repeats=1, tm=32, tn=32)
        tokens, ep = 32, 1
    else:
        models = {m: MODELS[m] for m in args.models.split(",")}
        opts = Options(interpret=args.interpret, repeats=args.repeats, tm=args.tm, tn=args.tn)
        tokens, ep = args.tokens, args.ep
    kind = jax.devices()[0].device_kind
    peak = next((v for name, v in PEAKS.items() if name in kind), None)
    print(f"device: {kind} ({jax.default_backend()}), jax {jax.__version__}, interpret={opts.interpret}")
    print(f"dense peaks (TFLOP/s): {f'FP8 {peak[0]:.0f}, BF16 {peak[1]:.0f}' if peak else 'unknown for this device'}")
    first = next(iter(models.values()))
    # small: the same shapes as the timed runs' first projection, so their compilations are shared
    rows = tokens * first["top_k"] if args.small else 2048
    checks += check_kernels(rows, first["hidden"], first["inter"], first["experts"] if args.small else 8, opts)
    for model, shape in models.items():
        if not opts.interpret or args.small:
            bench_grouped(model, shape, tokens, opts, peak)
            checks += bench_layer(model, shape, tokens, ep, opts)
    failed = [c for c in checks if not c[1]]
    for name, ok, detail in checks:
        print(f"{'PASS' if ok else 'FAIL'} {name:40s} {detail}")
    print(f"{len(checks) - len(failed)}/{len(checks)} checks passed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
