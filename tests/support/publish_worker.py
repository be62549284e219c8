"""One process of a two-process weight publish (run by test_multiprocess_publish.py, not by pytest).

usage: python publish_worker.py PROCESS_ID PORT GATHER_URL SHARDED_URL HF_DIR TRAINER_URL
       python publish_worker.py quick PROCESS_ID PORT SHARDED_URL   (`quick_tree` per shard only)

Joins a 2-process JAX job (2 CPU devices each, gloo), builds `publish_tree` as global arrays on a
(data=2, fsdp=2) mesh whose data axis spans the processes, and publishes versions 0 and 1 twice:
through the single-writer path (`published_copy` gathers to every process, process 0's
WeightPublisher writes) and per shard (`ShardedWeightPublisher`: each process writes its own
replica-0 shards, version 1 as a per-shard XOR delta). The RL trainer's own publish
(`store_publisher`, per shard with two processes) then writes versions 0-2 to TRAINER_URL, and a
restarted trainer (resumed at step 1) rewinds the store and publishes version 2 anew from
`publish_tree(3)`. Last it exports the tiny model (`export_model_config`, initialised from
`EXPORT_SEED`, its parameters split over both processes) as a Hugging Face checkpoint to HF_DIR
(`save_pretrained`: process 0 writes).
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

PUBLISH_DTYPE = "bfloat16"
# path -> (shape, dtype, partition spec over the (data, fsdp) mesh)
LAYOUT = {
    "embed": ((8, 6), "float32", ("data", "fsdp")),
    "norm": ((8, 4), "float32", ("fsdp", None)),  # replicated over data: one process writes it
    "scale": ((5,), "bfloat16", ()),  # replicated everywhere
    "counts": ((4, 2), "int32", ("data", None)),
    "layer": {"w": ((6, 8), "float32", (None, ("data", "fsdp")))},
}


EXPORT_SEED = 7
EXPORT_SHARD_SIZE = "300KB"  # several safetensors files for the tiny model


def export_model_config(num_devices: int) -> Any:
    """The tiny model of the stage configs, with its parameters over fsdp (across the processes)
    and experts (within one)."""
    from composer_jax.config import load_config

    overrides = ["mesh.data=1", "mesh.fsdp=2", "mesh.expert=2"]
    return load_config("configs/pretrain/tiny_stage1.yaml", overrides, num_devices=num_devices)


def publish_tree(version: int, layout: dict = LAYOUT) -> dict:
    """The numpy tree of `version` (the same on every process and in the test)."""
    import ml_dtypes

    out: dict = {}
    for i, (k, v) in enumerate(sorted(layout.items())):
        if isinstance(v, dict):
            out[k] = publish_tree(version, v)
            continue
        shape, dtype, _ = v
        rng = np.random.default_rng(1000 * version + i)
        if dtype == "int32":
            out[k] = rng.integers(-50, 50, shape).astype(np.int32)
        else:
            out[k] = rng.standard_normal(shape).astype(np.float32).astype(getattr(ml_dtypes, dtype, dtype))
    return out


def quick_tree(version: int) -> np.ndarray:
    """The one leaf of the quick run: float32[8, 4] over (data, fsdp)."""
    return np.arange(32, dtype=np.float32).reshape(8, 4) * (1 + version)


def _join(pid: int, port: int) -> None:
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.config.update("jax_num_cpu_devices", 2)
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=2, process_id=pid)


def _quick(pid: int, port: int, url: str) -> None:
    """Versions 0 and 1 of `quick_tree` per shard (no model, no trainer import: a few seconds)."""
    _join(pid, port)
    import jax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    from composer_jax.weightsync.sharded import ShardedWeightPublisher

    mesh = jax.make_mesh((2, 2), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    sharding = NamedSharding(mesh, PartitionSpec("data", "fsdp"))
    publisher = ShardedWeightPublisher(url)
    for version in (0, 1):
        w = quick_tree(version)
        publisher.publish({"w": jax.make_array_from_callback(w.shape, sharding, w.__getitem__)}, version)


def _main(pid: int, port: int, gather_url: str, sharded_url: str, hf_dir: str, trainer_url: str) -> None:
    _join(pid, port)
    import jax
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    from composer_jax.weightsync.publisher import WeightPublisher, published_copy, store_publisher
    from composer_jax.weightsync.sharded import ShardedWeightPublisher

    mesh = jax.make_mesh((2, 2), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)

    def to_global(tree: dict, layout: dict) -> dict:
        out: dict = {}
        for k, v in tree.items():
            if isinstance(v, dict):
                out[k] = to_global(v, layout[k])
                continue
            sharding = NamedSharding(mesh, PartitionSpec(*layout[k][2]))
            out[k] = jax.make_array_from_callback(v.shape, sharding, v.__getitem__)
        return out

    publisher = WeightPublisher(gather_url) if jax.process_index() == 0 else None
    per_shard = ShardedWeightPublisher(sharded_url)  # on every process
    for version in (0, 1):
        params = to_global(publish_tree(version), LAYOUT)
        host = published_copy(params, PUBLISH_DTYPE)  # a collective: both processes
        if publisher is not None:
            publisher.publish(host, version)
        per_shard.publish(params, version, dtype=PUBLISH_DTYPE)
    print(f"process {pid} published", flush=True)

    quiet = lambda line: None  # noqa: E731
    publish = store_publisher(trainer_url, resumed=False, start=0, dtype=PUBLISH_DTYPE, echo=quiet)
    for version in (0, 1, 2):
        publish(to_global(publish_tree(version), LAYOUT), version)
    # the trainer restarts from its step-1 checkpoint: version 2 was of the lost run
    publish = store_publisher(trainer_url, resumed=True, start=1, dtype=PUBLISH_DTYPE, echo=print)
    publish(to_global(publish_tree(1), LAYOUT), 1)  # the checkpoint's own version: skipped
    publish(to_global(publish_tree(3), LAYOUT), 2)

    from composer_jax.hf.weights import save_pretrained
    from composer_jax.model.params import init_params
    from composer_jax.sharding import ShardingRules, make_mesh

    cfg = export_model_config(4)
    model_mesh = make_mesh(cfg.mesh)
    model = init_params(cfg.model, jax.random.key(EXPORT_SEED), model_mesh, ShardingRules.create(cfg.sharding_rules))
    save_pretrained(model, cfg.model, hf_dir, max_shard_size=EXPORT_SHARD_SIZE)
    print(f"process {pid} exported", flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "quick":
        _quick(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
    else:
        _main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:7])
