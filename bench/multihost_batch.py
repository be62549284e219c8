"""Bytes each process of a multi-host RL trainer receives per step for the batch
(`checkpoint.multihost.scatter_arrays`), against the whole batch that every process received before.

Starts `--processes` real JAX processes on this machine (CPU, gloo, `--devices` each), builds an RL
batch of `--rows` x `--seq` (the six int32/float32 arrays of `rl/algo/batch.py` plus routing of
`--moe-layers` x `--k`) on process 0, scatters it over a mesh whose batch axis spans every device
(the rules' `act_batch`), checks every shard on every process against the same numpy arrays and
prints, per process, the bytes it received (from the blocks sent) and the whole batch's bytes.
Then the same arithmetic for a batch of `--at-scale` rows x seq x moe layers x k on P processes
(default: the docs/scaling.md worked example, 512 x 32768 tokens, Kimi K2's 60 MoE layers x 8, 32
processes of 8 H200): each process holds 1/P of the batch when every device holds a distinct block.

    PYTHONPATH=src .venv/bin/python bench/multihost_batch.py [--processes 2 --devices 2 --rows 8 --seq 192
        --moe-layers 1 --k 2] [--at-scale 512,32768,60,8,32]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys

import numpy as np

KEYS_4_BYTES = ("tokens", "segment_ids", "positions", "loss_mask", "advantages", "sampler_logprobs")


def batch(rows: int, seq: int, moe_layers: int, k: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {key: rng.integers(0, 1000, (rows, seq)).astype(np.int32) for key in KEYS_4_BYTES}
    out["advantages"] = rng.normal(size=(rows, seq)).astype(np.float32)
    out["routing"] = rng.integers(0, 8, (rows, seq, moe_layers, k)).astype(np.int32)
    return out


def child(args) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", args.devices)
    jax.distributed.initialize(
        coordinator_address=f"127.0.0.1:{args.port}", num_processes=args.processes, process_id=args.child
    )
    from jax.sharding import NamedSharding, PartitionSpec

    from composer_jax.multihost import scatter_arrays

    mesh = jax.make_mesh((args.processes * args.devices,), ("data",))
    sharding = NamedSharding(mesh, PartitionSpec("data", None))
    want = batch(args.rows, args.seq, args.moe_layers, args.k)
    out, received = scatter_arrays(want if args.child == 0 else None, sharding)
    for key, v in out.items():
        for s in v.addressable_shards:
            assert np.array_equal(np.asarray(s.data), want[key][s.index]), (key, s.index)
    if args.child == 0:
        print(json.dumps({"received": received, "whole": sum(v.nbytes for v in want.values())}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--seq", type=int, default=192)
    ap.add_argument("--moe-layers", type=int, default=1)
    ap.add_argument("--k", type=int, default=2)
    ap.add_argument("--at-scale", default="512,32768,60,8,32", help="rows,seq,moe_layers,k,processes")
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child is not None:
        child(args)
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "XLA_FLAGS": "", "TF_CPP_MIN_LOG_LEVEL": "2"}
    cmd = [sys.executable, __file__, *sys.argv[1:], "--port", str(port)]
    procs = [
        subprocess.Popen([*cmd, "--child", str(i)], env=env, stdout=subprocess.PIPE, text=True)
        for i in range(args.processes)
    ]
    try:
        outs = [p.communicate(timeout=600)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        raise SystemExit(f"a process failed: return codes {[p.returncode for p in procs]}")
    res = json.loads([x for x in outs[0].splitlines() if x.startswith("{")][-1])
    whole = res["whole"]
    print(
        f"batch {args.rows} x {args.seq} tokens, routing {args.moe_layers} x {args.k}: {whole:,} bytes; "
        f"{args.processes} processes x {args.devices} devices, every shard checked"
    )
    for q, got in enumerate(res["received"]):
        was = "it builds the batch" if q == 0 else f"before: {whole:,}, all of it"
        print(f"  process {q}: received {got:,} bytes ({got / whole:.3f} of the batch; {was})")
    rows, seq, layers, k, n = (int(x) for x in args.at_scale.split(","))
    per_token = 4 * len(KEYS_4_BYTES) + 4 * layers * k
    big = rows * seq * per_token
    print(
        f"at scale: {rows} x {seq} tokens x {per_token} bytes per token = {big / 1e9:.1f} GB per step; "
        f"{n} processes: each receives {big / n / 1e9:.2f} GB (before: {big / 1e9:.1f} GB each), "
        f"process 0 sends {big * (n - 1) / n / 1e9:.1f} GB"
    )


if __name__ == "__main__":
    main()
