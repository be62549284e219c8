"""MoE layer forward+backward time on CPU, next to (a) a dense SwiGLU MLP with the same active FLOPs
and (b) the same layer built on `jax.lax.ragged_dot`.

Model: the shared reference benchmark config (../shared/bench/moe_bench_config.json when present,
else the same numbers embedded here): hidden 256, 16 routed experts of width 256, top-4 in 2 of 4
groups, 1 shared expert; batch 8 x 512 tokens, float32. Target: tiled MoE within 2x of the dense MLP.

    .venv/bin/python bench/moe_layer.py [--tokens 4096] [--repeats 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from composer_jax.config import ModelConfig
from composer_jax.model.layers import swiglu
from composer_jax.model.moe import layer

REFERENCE = Path(__file__).resolve().parents[1] / ".." / "shared" / "bench" / "moe_bench_config.json"
EMBEDDED = {
    "hidden_size": 256,
    "moe_intermediate_size": 256,
    "n_routed_experts": 16,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
}


def load_reference() -> tuple[dict, str]:
    if REFERENCE.exists():
        return json.loads(REFERENCE.read_text()), "shared/bench/moe_bench_config.json"
    return EMBEDDED, "embedded copy of the reference config"


def timeit(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    ref, source = load_reference()
    cfg = ModelConfig(
        hidden_size=ref["hidden_size"],
        moe_intermediate_size=ref["moe_intermediate_size"],
        num_experts=ref["n_routed_experts"],
        num_experts_per_tok=ref["num_experts_per_tok"],
        n_group=ref["n_group"],
        topk_group=ref["topk_group"],
        num_shared_experts=ref["n_shared_experts"],
        routed_scaling_factor=ref["routed_scaling_factor"],
        score_func="sigmoid",
        topk_method="noaux_tc",
    )
    d, e, f, k, s = (
        cfg.hidden_size,
        cfg.num_experts,
        cfg.moe_intermediate_size,
        cfg.num_experts_per_tok,
        cfg.num_shared_experts,
    )
    t = args.tokens
    keys = jax.random.split(jax.random.key(0), 10)
    n = lambda key, shape: 0.05 * jax.random.normal(key, shape, jnp.float32)
    p = {
        "router": n(keys[0], (d, e)),
        "router_bias": jnp.zeros((e,)),
        "gate": n(keys[1], (e, d, f)),
        "up": n(keys[2], (e, d, f)),
        "down": n(keys[3], (e, f, d)),
        "shared_gate": n(keys[4], (d, s * f)),
        "shared_up": n(keys[5], (d, s * f)),
        "shared_down": n(keys[6], (s * f, d)),
    }
    x = jax.random.normal(keys[7], (8, t // 8, d), jnp.float32)
    fd = (k + s) * f  # dense MLP width with the same active FLOPs as routed top-k + shared
    dense_p = {"gate": n(keys[8], (d, fd)), "up": n(keys[9], (d, fd)), "down": n(keys[1], (fd, d))[:, :d]}

    def moe_loss(p, x, impl):
        y, _, _ = layer.moe_layer(p, x, dataclasses.replace(cfg, moe_impl=impl), None)
        return jnp.sum(y * y)

    def dense_loss(p, x):
        return jnp.sum(jnp.square(swiglu(x, p["gate"], p["up"], p["down"])))

    step = lambda loss, *static: jax.jit(jax.value_and_grad(loss, argnums=(0, 1)), static_argnums=static)
    flops = 3 * (2 * t * d * fd) * 3  # three matmuls, forward + 2x backward
    results = {}
    results["dense"] = timeit(step(dense_loss), dense_p, x, repeats=args.repeats)
    for impl in ("tiled", "ragged"):
        results[impl] = timeit(step(moe_loss, 2), p, x, impl, repeats=args.repeats)
    print(f"MoE layer forward+backward on {jax.devices()[0].platform.upper()} ({source}):")
    print(
        f"  tokens {t}, hidden {d}, {e} experts x {f} (top-{k}) + {s} shared; active matmul FLOPs "
        f"{flops / 1e9:.2f} GFLOP per step"
    )
    for name, label in (
        ("dense", "dense SwiGLU, same active FLOPs"),
        ("tiled", "MoE, tiled grouped matmul (ours)"),
        ("ragged", "MoE, jax.lax.ragged_dot"),
    ):
        sec = results[name]
        print(
            f"  {label:<36} {sec * 1e3:9.1f} ms   {flops / sec / 1e9:7.1f} GFLOP/s   "
            f"{sec / results['dense']:5.2f}x dense"
        )
    ratio = results["tiled"] / results["dense"]
    print(
        f"  target: tiled MoE within 2x of dense -> {ratio:.2f}x ({'met' if ratio <= 2 else 'NOT met'}); "
        f"ragged_dot is {results['ragged'] / results['tiled']:.1f}x slower than tiled on this backend"
    )


if __name__ == "__main__":
    main()
