"""Routed-expert SwiGLU of one inference step (decode, speculative verify, short prefill), per layer,
for each way of computing it: the schemes `model.moe.decode.decode_swiglu` chooses from, next to the
per-assignment gather the decode path used before.

Shapes: the shared reference model's MoE layer (hidden 256, 16 experts of width 256, top-4),
float32. A stack of `--layers` layers with their own weights (8 x 12.6 MB, more than this CPU's
32 MB L3), chained as in the model, so each layer's weights come from memory as in a real step
rather than from cache. Steps of t tokens; for t <= 4 (a verify window) the tokens share most of
their experts, as consecutive tokens of a sequence tend to; above, experts are drawn at random.

    PYTHONPATH=src .venv/bin/python bench/moe_decode.py [--tokens 1,2,4,8,16,32,64,256]

Prints ms per layer for each scheme (best of 5 runs of 10 steps) and the one
`moe.decode_strategy` picks; every scheme's output is checked against the gathered one.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from composer_jax.model.moe import decode as moe

E, D, F, K = 16, 256, 256, 4


def _gathered(x, ex, w, g, u, dn):
    """The old decode path: every assignment's expert weights gathered (copied), then its SwiGLU."""
    e = ex.reshape(-1)
    xa = jnp.repeat(x, ex.shape[1], axis=0)
    h = jax.nn.silu(jnp.einsum("ad,adf->af", xa, g[e])) * jnp.einsum("ad,adf->af", xa, u[e])
    y = jnp.einsum("af,afd->ad", h, dn[e]).reshape(*ex.shape, x.shape[-1])
    return jnp.einsum("tkd,tk->td", y, w)


def _step_experts(t: int, rng: np.random.Generator) -> np.ndarray:
    """int32[t, K]: a verify window's tokens (t <= 4) mostly repeat the first token's experts."""
    base = rng.choice(E, K, replace=False)
    shared = t <= 4
    rows = [base if i == 0 or (shared and rng.random() < 0.6) else rng.choice(E, K, replace=False) for i in range(t)]
    return np.stack(rows).astype(np.int32)


def _scheme(strategy: str) -> Callable:
    return lambda x, ex, w, g, u, dn: moe.decode_swiglu(x, ex, w, g, u, dn, strategy)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="1,2,4,8,16,32,64,256")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--skip-gathered-above", type=int, default=32, help="the gather is very slow beyond")
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    weights = [
        tuple(jnp.asarray(rng.standard_normal(s, np.float32) * 0.05) for s in [(E, D, F), (E, D, F), (E, F, D)])
        for _ in range(args.layers)
    ]
    schemes = {
        "gathered": _gathered,
        "loop": _scheme("loop"),
        "dense": _scheme("dense"),
        "grouped": _scheme("grouped"),
        "tiled": _scheme("tiled"),
    }

    def chain(f: Callable) -> Callable:
        def run(x, exs, w):
            for i in range(args.layers):
                x = x + 0.1 * f(x, exs[i], w, *weights[i])
            return x

        return jax.jit(run)

    print(f"jax {jax.__version__} on {jax.devices()[0].platform}; ms per MoE layer (routed experts only)")
    print("tokens | " + " | ".join(f"{n:>8}" for n in schemes) + " | picked")
    for t in [int(a) for a in args.tokens.split(",")]:
        x = jnp.asarray(rng.standard_normal((t, D), np.float32))
        exs = [jnp.asarray(_step_experts(t, rng)) for _ in range(args.layers)]
        w = jnp.asarray(rng.random((t, K), np.float32))
        ref = None
        cells = []
        for name, f in schemes.items():
            if name == "gathered" and t > args.skip_gathered_above:
                cells.append(f"{'-':>8}")
                continue
            fn = chain(f)
            out = np.asarray(fn(x, exs, w))
            if ref is None:
                ref = out
            err = float(np.abs(out - ref).max() / (np.abs(ref).max() + 1e-30))
            assert err < 1e-5, f"{name} at t={t} differs from the reference by {err:.2e} (relative)"
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(10):
                    o = fn(x, exs, w)
                o.block_until_ready()
                best = min(best, (time.perf_counter() - t0) / 10 / args.layers)
            cells.append(f"{best * 1e3:8.3f}")
        print(f"{t:6d} | " + " | ".join(cells) + f" | {moe.decode_strategy(t, K, E)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
