"""Weight sync (src/composer_jax/rl/weight_sync.py): raw vs stored bytes and write/read times.

The tiny model's parameters (configs/model/tiny.yaml, `composer_jax.init_params`), cast to bfloat16
(as a sampler holds them) and in their own dtype, are published as a base and then as deltas after
Adam-like steps: every entry moves by `lr` relative, in a random direction
(w * (1 + lr * sign), the size of an Adam update normalised to the weight). For each `lr` the script
prints the share of entries whose bits changed (a bf16 weight does not move for a relative step
below half its spacing, 2^-9..2^-8), the raw bytes, the stored bytes of the delta (zstd of the XOR
of bit patterns, zarr3 metadata included), their ratio, the publish and read times, and checks the read is bit-exact.

    PYTHONPATH=src .venv/bin/python bench/weight_sync.py [--url file:///tmp/ws] [--lrs 1e-3,1e-6]
"""

from __future__ import annotations

import argparse
import functools
import tempfile
import time
from collections.abc import Callable

import jax
import ml_dtypes
import numpy as np

import composer_jax as cj
from composer_jax.rl.weight_sync import WeightPublisher, WeightSubscriber, tree_sha256


def _map(tree: dict, fn: Callable[[np.ndarray], np.ndarray]) -> dict:
    return {k: _map(v, fn) if isinstance(v, dict) else fn(v) for k, v in tree.items()}


def _leaves(tree: dict) -> list[np.ndarray]:
    return [x for k in sorted(tree) for x in (_leaves(tree[k]) if isinstance(tree[k], dict) else [tree[k]])]


def _bits(a: np.ndarray) -> np.ndarray:
    return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def _adam_like(a: np.ndarray, lr: float, rng: np.random.Generator) -> np.ndarray:
    return (a.astype(np.float32) * (1 + lr * rng.choice([-1.0, 1.0], a.shape))).astype(a.dtype)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default=None, help="kvstore URL (default: file:// of a temporary directory)")
    ap.add_argument("--lrs", default="1e-3,1e-6", help="comma-separated relative step sizes")
    ap.add_argument("--config", default="configs/model/tiny.yaml")
    args = ap.parse_args()
    cfg = cj.load_config(args.config)
    params = jax.device_get(cj.init_params(cfg.model, jax.random.key(0)))
    params = _map(params, np.asarray)
    rng = np.random.default_rng(0)
    for label, cast in (("bfloat16", lambda a: a.astype(ml_dtypes.bfloat16)), ("native", lambda a: a)):
        p0 = _map(params, cast)
        for lr in (float(x) for x in args.lrs.split(",")):
            with tempfile.TemporaryDirectory() as tmp:
                url = args.url or f"file://{tmp}/ws"
                if args.url:
                    url = f"{args.url.rstrip('/')}/{label}_{lr:g}"
                pub = WeightPublisher(url, new_base_fraction=1e9)
                t0 = time.perf_counter()
                base = pub.publish(p0)
                t_base = time.perf_counter() - t0
                p1 = _map(p0, functools.partial(_adam_like, lr=lr, rng=rng))
                t0 = time.perf_counter()
                delta = pub.publish(p1)
                t_delta = time.perf_counter() - t0
                sub = WeightSubscriber(url)
                t0 = time.perf_counter()
                _, got = sub.read()
                t_read = time.perf_counter() - t0
                exact = tree_sha256(got) == tree_sha256(p1)
                changed = sum(int(np.sum(_bits(a) != _bits(b))) for a, b in zip(_leaves(p0), _leaves(p1), strict=True))
                total = sum(a.size for a in _leaves(p0))
                print(
                    f"{label:8s} lr={lr:g}: entries changed {changed / total:.2%}; raw {base.raw_bytes / 1e6:.3f} MB;"
                    f" base stored {base.stored_bytes / 1e6:.3f} MB"
                    f" ({base.stored_bytes / base.raw_bytes:.1%}) write {t_base:.2f}s; delta stored"
                    f" {delta.stored_bytes / 1e6:.3f} MB ({delta.stored_bytes / delta.raw_bytes:.1%} of raw) write"
                    f" {t_delta:.2f}s; read base+delta {t_read:.2f}s; bit-exact {exact}"
                )
                if not exact:
                    raise SystemExit("read-back is not bit-exact")


if __name__ == "__main__":
    main()
