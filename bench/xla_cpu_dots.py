"""XLA:CPU flag sets against the decode path's products: which of jaxlib's CPU-backend flags (XNNPACK,
oneDNN, YNNPACK fusions, matmul tiling, vector width, fast math, ...) make decoding faster.

XLA reads `XLA_FLAGS` once per process, so every flag set runs in a child process of its own
(`XLA_FLAGS` set before JAX starts; the child pins itself to `--threads` cores first, as
bench/decode.py does, so XLA's pool is sized from them). Each child times, in CPU time of the
process (little disturbed by other jobs on a shared machine), min and median of `--repeats` calls
after a warm-up, with random weights of the shared reference model's shapes
(`../shared/bench/moe_bench_config.json`):

- `head r`: the output head's product [r, hidden] x [hidden, vocab] (float32), r in `--rows`
  (1: a plain batch-1 step; 4: a speculative verify window of k = 3; 16: a batch-16 step);
- `moe t`: one routed-expert SwiGLU layer (`moe.decode.decode_swiglu` with the scheme the decode path picks
  for t tokens) over `--layers` chained layers with their own weights (so they stream from memory),
  reported per layer;
- `step b`: one jitted forward of the whole model over a KV cache holding `--context` tokens, one new
  token per row, batch b in `--batches` (the decode step, logits included);
- `verify 4`: the same forward with 4 new tokens at batch 1 (the k = 3 verify window).

Every output is compared with the first flag set's (the baseline, normally the empty set): the
largest absolute difference, and for the forward's logits the largest difference of the
log-softmax (log-probabilities) and whether every row's arg-max (the greedy token) is the same.

    PYTHONPATH=src .venv/bin/python bench/xla_cpu_dots.py [--threads 1] [--repeats 30]
        [--rounds 2] [--sets "none;xnn-dot;..."] [--list]

`--sets` takes names of the presets below (`--list` prints them) or raw flag strings (anything with
`--`), separated by ';'. A child that crashes or rejects a flag is reported with its last error line
and the table goes on. `--rounds N` runs the sets round-robin N times and keeps each piece's lowest
min and median (load changes then hit every set alike). Findings (jaxlib 0.10.2: no set beats the
default, which already sends every dot to YNNPACK) are in docs/results/xla_cpu_flags.md (docs/inference.md,
"XLA:CPU flags", says what it times).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "bench" / "moe_bench_config.json"

# jaxlib 0.10.2's defaults (xla/debug_options_flags.cc): every dot goes to YNNPACK on its own
# (`xla_cpu_experimental_ynn_fusion_type` = individual_dot), XNNPACK on, oneDNN off, vector width 256.
NO_YNN = "--xla_cpu_experimental_ynn_fusion_type=-individual_dot"
PRESETS: dict[str, str] = {
    "none": "",
    "ynn-off": NO_YNN,
    "ynn-off-xnnpack-off": f"{NO_YNN} --xla_cpu_use_xnnpack=false",
    "ynn-dot": "--xla_cpu_experimental_ynn_fusion_type=dot",
    "ynn-dot-eltwise": "--xla_cpu_experimental_ynn_fusion_type=dot,eltwise",
    "ynn-all": "--xla_cpu_experimental_ynn_fusion_type=dot,eltwise,reduce",
    "xnn-dot": f"{NO_YNN} --xla_cpu_experimental_xnn_fusion_type=dot",
    "xnn-all": f"{NO_YNN} --xla_cpu_experimental_xnn_fusion_type=dot,eltwise,reduce",
    "xnn-graph": "--xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_GREEDY",
    "onednn": f"{NO_YNN} --xla_cpu_use_onednn=true",
    "onednn-dot": f"{NO_YNN} --xla_cpu_experimental_onednn_fusion_type=dot",
    "tiling-8x256x256": (
        "--xla_cpu_enable_custom_matmul_tiling=true --xla_cpu_matmul_tiling_m_dim=8 "
        "--xla_cpu_matmul_tiling_n_dim=256 --xla_cpu_matmul_tiling_k_dim=256"
    ),
    "vector-512": "--xla_cpu_prefer_vector_width=512",
    "isa-avx2": "--xla_cpu_max_isa=AVX2",
    "fast-math": "--xla_cpu_enable_fast_math=true",
    "legacy-emitters": "--xla_cpu_use_fusion_emitters=false",
    "isa-avx512": "--xla_cpu_max_isa=AVX512",
    "scheduler-off": "--xla_cpu_enable_concurrency_optimized_scheduler=false",
}
DEFAULT_SETS = (
    "none;ynn-off;ynn-off-xnnpack-off;ynn-dot;ynn-dot-eltwise;ynn-all;xnn-dot;xnn-graph;onednn-dot;"
    "tiling-8x256x256;vector-512;fast-math"
)


def _log_softmax(z: np.ndarray) -> np.ndarray:
    z = z.astype(np.float64)
    m = z.max(-1, keepdims=True)
    return z - m - np.log(np.exp(z - m).sum(-1, keepdims=True))


def _stats(fn, args, repeats: int) -> tuple[float, float, object]:
    """(min, median) CPU ms of fn(*args) over `repeats` calls after one warm-up call; its output."""
    import jax

    out = jax.block_until_ready(fn(*args))
    ts = []
    for _ in range(repeats):
        c0 = time.process_time()
        jax.block_until_ready(fn(*args))
        ts.append(time.process_time() - c0)
    return float(np.min(ts)) * 1e3, float(np.median(ts)) * 1e3, out


def child(args: argparse.Namespace) -> int:
    """Time every piece under this process's XLA_FLAGS; write a JSON summary and the outputs."""
    allowed = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, set(allowed[: args.threads]))  # before XLA sizes its pool
    import jax
    import jax.numpy as jnp

    from composer_jax.hf.config import model_config_from_hf
    from composer_jax.model.kv_cache import init_cache
    from composer_jax.model.moe import decode as moe
    from composer_jax.model.params import init_params
    from composer_jax.model.transformer import forward_cached

    cfg, _ = model_config_from_hf(json.loads(args.reference.read_text()))
    rng = np.random.default_rng(0)
    d, v = cfg.hidden_size, cfg.vocab_size
    times: dict[str, tuple[float, float]] = {}
    outs: dict[str, np.ndarray] = {}

    w_head = jnp.asarray(rng.standard_normal((d, v), np.float32) * d**-0.5)
    head = jax.jit(lambda x, w: x @ w)
    for r in [int(x) for x in args.rows.split(",")]:
        x = jnp.asarray(rng.standard_normal((r, d), np.float32))
        lo, med, out = _stats(head, (x, w_head), args.repeats)
        times[f"head {r}"], outs[f"head {r}"] = (lo, med), np.asarray(out)

    e, k, f = cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size
    layers = [
        tuple(jnp.asarray(rng.standard_normal(s, np.float32) * 0.05) for s in [(e, d, f), (e, d, f), (e, f, d)])
        for _ in range(args.layers)
    ]
    for t in [int(x) for x in args.moe_tokens.split(",")]:
        scheme = moe.decode_strategy(t, k, e)
        ex = jnp.asarray(np.stack([rng.permutation(e)[:k] for _ in range(t)]).astype(np.int32))
        wt = jnp.full((t, k), 1.0 / k, jnp.float32)

        def chain(x, ex, wt, scheme=scheme):
            for g, u, dn in layers:
                x = x + 0.1 * moe.decode_swiglu(x, ex, wt, g, u, dn, scheme)
            return x

        x = jnp.asarray(rng.standard_normal((t, d), np.float32))
        lo, med, out = _stats(jax.jit(chain), (x, ex, wt), args.repeats)
        times[f"moe {t} ({scheme})"] = (lo / args.layers, med / args.layers)
        outs[f"moe {t} ({scheme})"] = np.asarray(out)

    params = init_params(cfg, jax.random.key(0))
    fwd = jax.jit(lambda p, t, c: forward_cached(p, t, cfg, c).logits)
    pieces = [(f"step {b}", b, 1) for b in [int(x) for x in args.batches.split(",")]] + [("verify 4", 1, 4)]
    for name, b, w in pieces:
        cache = init_cache(cfg, b, args.context + 8)
        cache = dataclasses.replace(cache, lengths=jnp.full((b,), args.context, jnp.int32))
        toks = jnp.asarray(rng.integers(0, v, (b, w)), jnp.int32)
        lo, med, out = _stats(fwd, (params, toks, cache), max(5, args.repeats // 3))
        times[name], outs[name] = (lo, med), np.asarray(out)

    np.savez(args.out + ".npz", **{n.replace(" ", "_"): a for n, a in outs.items()})  # type: ignore[arg-type]
    Path(args.out + ".json").write_text(json.dumps({"times": times, "names": list(outs)}))
    return 0


def parent(args: argparse.Namespace) -> int:
    allowed = sorted(os.sched_getaffinity(0))
    if not 1 <= args.threads <= len(allowed):
        print(f"--threads {args.threads}: give 1..{len(allowed)} (this process's cores: {allowed})", file=sys.stderr)
        return 2
    if not args.reference.exists():
        print(f"bench/xla_cpu_dots.py: the reference config {args.reference} is missing", file=sys.stderr)
        return 2
    sets = []
    for item in [s.strip() for s in args.sets.split(";") if s.strip() or s == ""]:
        if "--" in item:
            sets.append((item, item))
        elif item in PRESETS:
            sets.append((item, PRESETS[item]))
        else:
            print(
                f"--sets: unknown preset {item!r}; presets: {', '.join(PRESETS)} (or a raw flag string)",
                file=sys.stderr,
            )
            return 2
    base_flags = os.environ.get("XLA_FLAGS", "")
    print(
        f"XLA:CPU flag sets, {args.threads} thread(s) pinned, CPU ms (min / median of {args.repeats}; the forward "
        f"pieces {max(5, args.repeats // 3)}); load average {os.getloadavg()[0]:.1f}"
        + (f"; inherited XLA_FLAGS {base_flags!r} come first" if base_flags else "")
    )
    ok: list[tuple[str, str, dict, dict]] = []
    failed: list[tuple[str, str, str]] = []
    by_name: dict[str, tuple[str, dict, dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):  # round-robin, so a change in the machine's load hits every set alike
            for i, (name, flags) in enumerate(sets):
                if any(f[0] == name for f in failed):
                    continue
                out = str(Path(tmp) / f"set{i}_{rnd}")
                env = dict(os.environ, XLA_FLAGS=f"{base_flags} {flags}".strip(), TF_CPP_MIN_LOG_LEVEL="2")
                cmd = [sys.executable, __file__, "--child", "--out", out] + _passthrough(args)
                t0 = time.perf_counter()
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
                took = time.perf_counter() - t0
                if proc.returncode != 0:
                    lines = [ln for ln in (proc.stderr + proc.stdout).strip().splitlines() if ln.strip()]
                    err = lines[-1][:200] if lines else f"exit {proc.returncode}"
                    print(f"  {name}: FAILED ({err})", flush=True)
                    failed.append((name, flags, err))
                    continue
                summary = json.loads(Path(out + ".json").read_text())
                print(f"  round {rnd + 1}, {name}: done in {took:.0f} s", flush=True)
                if name in by_name:  # keep each piece's best (min, median) over the rounds
                    best = by_name[name][1]["times"]
                    for piece, (lo, med) in summary["times"].items():
                        best[piece] = (min(lo, best[piece][0]), min(med, best[piece][1]))
                else:
                    by_name[name] = (flags, summary, dict(np.load(out + ".npz")))
    ok = [(name, flags, summary, arrays) for name, (flags, summary, arrays) in by_name.items()]
    if not ok:
        return 1
    base_name, _, base_summary, base_arrays = ok[0]
    pieces = list(base_summary["times"])
    print(
        f"\nCPU ms, min / median (and the median's speed-up over {base_name!r}); with --rounds > 1 the lowest"
        " over the rounds; failed sets at the end"
    )
    print("flag set | " + " | ".join(pieces))
    for name, _, summary, _ in ok:
        cells = []
        for p in pieces:
            lo, med = summary["times"][p]
            cells.append(f"{lo:.2f} / {med:.2f} ({base_summary['times'][p][1] / med:.2f}x)")
        print(f"{name} | " + " | ".join(cells))
    print(f"\nnumerics against {base_name!r}: largest |difference| of each output; for the forward pieces also of")
    print("the log-softmax (log-probabilities) and the share of rows whose arg-max (greedy token) is unchanged")
    for name, _, _, arrays in ok[1:]:
        cells = []
        for p in pieces:
            key = p.replace(" ", "_")
            a, b = base_arrays[key], arrays[key]
            cell = f"{p}: {np.abs(a - b).max():.1e}"
            if p.startswith(("step", "verify")):
                same = float((a.argmax(-1) == b.argmax(-1)).mean())
                cell += f" (log-probs {np.abs(_log_softmax(a) - _log_softmax(b)).max():.1e}, argmax {same:.0%})"
            cells.append(cell)
        print(f"  {name}: " + "; ".join(cells))
    for name, flags, err in failed:
        print(f"  {name} ({flags}): failed: {err}")
    print("\nflag sets: " + "; ".join(f"{n} = {f!r}" for n, f, *_ in ok + failed))
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    return 0


def _passthrough(args: argparse.Namespace) -> list[str]:
    return [
        f"--threads={args.threads}",
        f"--repeats={args.repeats}",
        f"--rows={args.rows}",
        f"--moe-tokens={args.moe_tokens}",
        f"--layers={args.layers}",
        f"--batches={args.batches}",
        f"--context={args.context}",
        f"--reference={args.reference}",
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sets", default=DEFAULT_SETS, help="';'-separated preset names or raw flag strings")
    ap.add_argument("--list", action="store_true", help="print the presets and exit")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=1, help="run every set this many times, round-robin; best kept")
    ap.add_argument("--rows", default="1,4,16", help="rows of the output head's product")
    ap.add_argument("--moe-tokens", default="1,4,16", help="tokens of the MoE layer")
    ap.add_argument("--layers", type=int, default=4, help="chained MoE layers (own weights each)")
    ap.add_argument("--batches", default="1,16", help="batch sizes of the whole decode step")
    ap.add_argument("--context", type=int, default=64, help="tokens already in the KV cache")
    ap.add_argument("--reference", type=Path, default=REFERENCE, help="the reference model's config.json")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.list:
        for n, f in PRESETS.items():
            print(f"{n:22s} {f!r}")
        return 0
    return child(args) if args.child else parent(args)


if __name__ == "__main__":
    sys.exit(main())
