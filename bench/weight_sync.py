"""Weight sync (src/composer_jax/weightsync/publisher.py, subscriber.py): raw vs stored bytes and write/read times.

Two measurements on the tiny model's parameters (configs/model/tiny.yaml, `composer_jax.init_params`):

1. `--lrs`: one relative step per entry. Every entry moves by `lr` relative in a random direction
   (w * (1 + lr * sign)), cast to bfloat16 and in its own dtype, published as base then delta. A bf16
   weight does not move for a relative step below half its spacing (2^-9..2^-8), so at 1e-6 nothing
   changes: this is the upper/lower bound, not what an RL run publishes.
2. `--rl-lr` (default 1e-6), the RL measurement: what trainers do. The master weights are float32 and
   optimised by Adam (optax.adam, lr as given, b1=0.9, b2=0.999) on gradients g_t = d + n_t with a fixed
   direction d and fresh noise n_t (both standard normal per entry: correlated over steps like real
   gradients, so Adam's step is close to lr per entry); after each step the bf16 copy that samplers
   hold is published. Rounding to bf16 hides most single steps, but the master weights accumulate and
   cross a bf16 rounding boundary now and then, so each version differs from the base in a growing
   set of entries. Both publisher modes are measured (`--delta-against`): "previous" XORs each version
   with the one before (one step's change), "base" with the latest base (grows with the versions
   since it). A new base is written when the deltas since it reach `--new-base-fraction` of the
   base. Printed per version: kind, entries differing from its parent (the XOR's non-zeros), stored
   bytes (zarr metadata included: 53 zarr.json files, about 17 KB = 2.6% of this tiny model's bf16
   bytes, negligible for a large model) and their share of the raw bf16 model; then the mean stored
   bytes per version over the run (bases included) as a share of the raw bf16 model, what a
   subscriber that follows every version reads per version (in "previous" mode a new base also
   gets a delta beside it, which followers read instead), and whether every read is bit-exact.

    PYTHONPATH=src .venv/bin/python bench/weight_sync.py [--url file:///tmp/ws] [--lrs 1e-3,1e-6]
        [--rl-lr 1e-6 --rl-versions 20 --new-base-fraction 0.5 --delta-against previous,base]
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
import optax

import composer_jax as cj
from composer_jax.weightsync.publisher import WeightPublisher
from composer_jax.weightsync.store import tree_sha256
from composer_jax.weightsync.subscriber import WeightSubscriber


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
    ap.add_argument("--rl-lr", type=float, default=1e-6, help="Adam learning rate of the RL measurement (0: skip it)")
    ap.add_argument("--rl-versions", type=int, default=20, help="versions published in the RL measurement")
    ap.add_argument("--new-base-fraction", type=float, default=0.5, help="publisher's new-base threshold (RL run)")
    ap.add_argument("--delta-against", default="previous,base", help="RL run: publisher modes to measure")
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
    if args.rl_lr > 0:
        for mode in args.delta_against.split(","):
            _rl_run(params, args, mode)


def _rl_run(params: dict, args: argparse.Namespace, mode: str) -> None:
    """fp32 master weights under Adam, the bf16 copy published each step (module docstring, 2.)."""
    to_bf16 = lambda t: _map(t, lambda a: np.asarray(a, np.float32).astype(ml_dtypes.bfloat16))
    master = jax.tree.map(lambda a: jax.numpy.asarray(a, jax.numpy.float32), params)
    opt = optax.adam(args.rl_lr)
    state = opt.init(master)
    key = jax.random.key(1)
    leaves, treedef = jax.tree.flatten(master)
    keys = jax.random.split(key, len(leaves) + 1)
    direction = jax.tree.unflatten(
        treedef, [jax.random.normal(k, a.shape) for k, a in zip(keys[1:], leaves, strict=True)]
    )

    @jax.jit
    def step(master, state, key):
        ks = jax.random.split(key, len(leaves))
        noise = jax.tree.unflatten(treedef, [jax.random.normal(k, a.shape) for k, a in zip(ks, leaves, strict=True)])
        grads = jax.tree.map(lambda d, n: d + n, direction, noise)
        updates, state = opt.update(grads, state, master)
        return optax.apply_updates(master, updates), state

    with tempfile.TemporaryDirectory() as tmp:
        url = f"{args.url.rstrip('/')}/rl_{args.rl_lr:g}_{mode}" if args.url else f"file://{tmp}/rl"
        pub = WeightPublisher(url, new_base_fraction=args.new_base_fraction, delta_against=mode)
        sub = WeightSubscriber(url)
        copy = to_bf16(jax.device_get(master))
        info = pub.publish(copy)
        ref_copy, total_stored, raw = copy, info.stored_bytes, info.raw_bytes
        exact, followed = True, 0
        sub.read()
        # the floor: a delta with no change (zarr metadata and all-zero chunks, a fixed cost per leaf
        # that a large model's bytes dwarf)
        floor_pub = WeightPublisher(f"file://{tmp}/floor", delta_against=mode)
        floor_pub.publish(copy)
        floor = floor_pub.publish(copy).stored_bytes
        print(
            f"RL run, deltas against the {mode} version: fp32 master + Adam lr={args.rl_lr:g}, bf16 copy published"
            " per step; raw bf16 model "
            f"{raw / 1e6:.3f} MB; version 0 base stored {info.stored_bytes / 1e6:.3f} MB"
        )
        for v in range(1, args.rl_versions + 1):
            key, sk = jax.random.split(key)
            master, state = step(master, state, sk)
            copy = to_bf16(jax.device_get(master))
            info = pub.publish(copy)
            total_stored += info.stored_bytes
            changed = sum(
                int(np.sum(_bits(a) != _bits(b))) for a, b in zip(_leaves(copy), _leaves(ref_copy), strict=True)
            )
            if info.kind == "base":
                changed = sum(a.size for a in _leaves(copy))
            if info.kind == "base" or mode == "previous":
                ref_copy = copy
            before = sub.bytes_read
            got_v, got = sub.read()
            followed += sub.bytes_read - before
            ok = got_v == v and tree_sha256(got) == tree_sha256(copy)
            exact = exact and ok
            total = sum(a.size for a in _leaves(copy))
            print(
                f"  version {v:3d} {info.kind:5s}: entries differing from its parent {changed / total:7.3%}; stored"
                f" {info.stored_bytes / 1e6:.4f} MB = {info.stored_bytes / raw:6.2%} of the raw bf16 model; a"
                f" follower read {(sub.bytes_read - before) / raw:6.2%}, {(sub.bytes_read - before - floor) / raw:6.2%}"
                f" above the no-change floor; bit-exact {ok}"
            )
        mean = total_stored / (args.rl_versions + 1)
        print(
            f"RL run ({mode}): mean stored bytes per version (bases included) {mean / 1e6:.4f} MB ="
            f" {mean / raw:.2%} of the raw bf16 model over {args.rl_versions + 1} versions; a subscriber following"
            f" every version read {followed / args.rl_versions / raw:.2%} per version, of which the no-change floor"
            f" (zarr metadata, empty chunks) is {floor / raw:.2%}: {(followed / args.rl_versions - floor) / raw:.2%}"
            f" of the raw bf16 model above it; all reads bit-exact {exact}"
        )
        if not exact:
            raise SystemExit("read-back is not bit-exact")


if __name__ == "__main__":
    main()
