"""Host memory while a stage loads a Hugging Face checkpoint through `train.init_from`.

Writes a synthetic DeepSeek-V3-layout checkpoint (random bfloat16 weights, several MoE layers,
several safetensors shards: `save_pretrained`, the hub per-expert layout) to a temporary directory,
then, in a fresh process on a fake 8-device CPU mesh (fsdp 2 x expert 4), loads it the way a stage
does (`model.from: hf:DIR`, `train.init_from: DIR` -> hf/init_from.py `load_init_params`) while a
thread samples /proc/self/status every 2 ms. Printed: the checkpoint's size, the parameters placed
on the devices (on CPU the devices' memory is the host's, so the loaded model itself is RSS), the
peak anonymous-RSS growth over that (the loader's transient host copies), the file-backed RSS
(memory-mapped safetensors pages, clean and reclaimable), and the largest single parameter and
device shard for comparison.

    python bench/hf_load_memory.py [--layers 6] [--experts 16] [--hidden 512] [--shard-size 40MB]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

MB = 1 << 20
MESH = {"data": 1, "fsdp": 2, "expert": 4, "context": 1, "tensor": 1}


def _model(args) -> dict:
    return dict(
        name="bench",
        vocab_size=32000,
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_heads=8,
        q_lora_rank=256,
        kv_lora_rank=128,
        qk_nope_head_dim=32,
        qk_rope_head_dim=16,
        v_head_dim=32,
        intermediate_size=4 * args.hidden,
        moe_intermediate_size=args.hidden,
        num_experts=args.experts,
        num_experts_per_tok=2,
        num_shared_experts=1,
        first_k_dense=1,
        n_group=4,
        topk_group=2,
        num_mtp_layers=0,
        param_dtype="bfloat16",
        compute_dtype="bfloat16",
    )


def write(out: Path, args) -> None:
    import jax
    import numpy as np

    from composer_jax.config import ModelConfig
    from composer_jax.hf.weights import save_pretrained
    from composer_jax.model.params import abstract_params

    cfg = ModelConfig(**_model(args))
    rng = np.random.default_rng(0)
    params = jax.tree.map(
        lambda s: (0.02 * rng.standard_normal(s.shape, np.float32)).astype(s.dtype), abstract_params(cfg)
    )
    save_pretrained(params, cfg, out, max_shard_size=args.shard_size)


def _status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[key] = int(value.split()[0]) * 1024
    return out


class Sampler(threading.Thread):
    """Peak RssAnon and RssFile of this process while running."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak = {"RssAnon": 0, "RssFile": 0}
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            s = _status()
            for k in self.peak:
                self.peak[k] = max(self.peak[k], s[k])
            time.sleep(0.002)


def load(path: str) -> dict:
    import jax

    jax.config.update("jax_num_cpu_devices", 8)
    jax.config.update("jax_platforms", "cpu")
    from composer_jax.config import config_from_dict, to_dict
    from composer_jax.hf.init_from import load_init_params, resolve_model_from
    from composer_jax.model.params import abstract_params
    from composer_jax.sharding import ShardingRules, make_mesh

    cfg = config_from_dict({"model": {"from": f"hf:{path}"}, "mesh": MESH, "train": {"init_from": path}}, num_devices=8)
    cfg = resolve_model_from(cfg)
    mesh, rules = make_mesh(cfg.mesh), ShardingRules.create()
    target = abstract_params(cfg.model, mesh, rules)
    shard = max(math.prod(s.sharding.shard_shape(s.shape)) * s.dtype.itemsize for s in jax.tree.leaves(target))
    largest = max(s.size * s.dtype.itemsize for s in jax.tree.leaves(target))
    total = sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(target))
    before = _status()
    sampler = Sampler()
    sampler.start()
    t0 = time.perf_counter()
    params, record = load_init_params(cfg, mesh, rules, to_dict(cfg))
    jax.block_until_ready(params)
    seconds = time.perf_counter() - t0
    sampler.stop.set()
    sampler.join()
    after = _status()
    placed = sum(sum(b.data.nbytes for b in x.addressable_shards) for x in jax.tree.leaves(params))
    return {
        "seconds": seconds,
        "params_bytes": total,
        "placed_bytes": placed,
        "largest_param_bytes": largest,
        "largest_shard_bytes": shard,
        "anon_growth_settled": after["RssAnon"] - before["RssAnon"],
        "anon_growth_peak": sampler.peak["RssAnon"] - before["RssAnon"],
        "file_rss_peak": sampler.peak["RssFile"] - before["RssFile"],
        "family": record["family"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--shard-size", default="40MB")
    ap.add_argument("--load", help=argparse.SUPPRESS)  # the child process: load DIR, print JSON
    args = ap.parse_args()
    if args.load:
        print(json.dumps(load(args.load)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "hf"
        write(out, args)
        files = sorted(out.glob("*.safetensors"))
        size = sum(f.stat().st_size for f in files)
        env = {**os.environ, "XLA_FLAGS": os.environ.get("XLA_FLAGS", "")}
        child = subprocess.run(
            [sys.executable, __file__, "--load", str(out)], capture_output=True, text=True, env=env, check=True
        )
        r = json.loads(child.stdout.strip().splitlines()[-1])
    print(f"checkpoint: {len(files)} safetensors shards, {size / MB:.1f} MiB ({r['family']}, bfloat16)")
    print(f"load through train.init_from on 8 CPU devices (fsdp 2 x expert 4): {r['seconds']:.1f} s")
    print(f"parameters placed on the devices: {r['placed_bytes'] / MB:.1f} MiB (model {r['params_bytes'] / MB:.1f})")
    print(
        f"anonymous RSS growth: settled {r['anon_growth_settled'] / MB:.1f} MiB, peak {r['anon_growth_peak'] / MB:.1f}"
        f" MiB: transient over the placed parameters "
        f"{(r['anon_growth_peak'] - r['placed_bytes']) / MB:.1f} MiB"
    )
    print(f"file-backed RSS (memory-mapped shards, reclaimable) peak: {r['file_rss_peak'] / MB:.1f} MiB")
    print(
        f"largest parameter {r['largest_param_bytes'] / MB:.1f} MiB, largest device shard "
        f"{r['largest_shard_bytes'] / MB:.1f} MiB"
    )


if __name__ == "__main__":
    main()
