"""Per-shard publishing in one process over the fake 8-device mesh (the two-process run is
test_multiprocess_publish.py): one writer per shard, replicas skipped, bit-exact read back."""

from __future__ import annotations

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from composer_jax.weightsync.publisher import WeightPublisher
from composer_jax.weightsync.sharded import ShardedWeightPublisher, publish_sharded
from composer_jax.weightsync.store import WeightSyncError
from composer_jax.weightsync.subscriber import WeightSubscriber, read_shard


def _tree(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "w": rng.standard_normal((8, 8)).astype(np.float32),
        "b": rng.standard_normal((4,)).astype(ml_dtypes.bfloat16),
        "ids": rng.integers(0, 9, (2, 4)).astype(np.int32),
        "step": np.asarray(seed, np.int32),  # a 0-d leaf
    }


def _global(tree: dict, mesh) -> dict:
    specs = {
        "w": PartitionSpec("data", "fsdp"),
        "b": PartitionSpec(),
        "ids": PartitionSpec(None, "fsdp"),
        "step": PartitionSpec(),
    }
    return {
        k: jax.make_array_from_callback(v.shape, NamedSharding(mesh, specs[k]), v.__getitem__) for k, v in tree.items()
    }


def test_sharded_versions_read_back_and_continue_with_deltas(tmp_path):
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    url = f"file://{tmp_path}/store"
    m = publish_sharded(url, _global(_tree(0), mesh), 0, dtype="bfloat16")
    leaves = {lf["path"]: lf for lf in m["leaves"]}
    # w [8, 8] over (data 2, fsdp 4): 8 shards of [4, 2], each on one device
    assert [s["index"] for s in leaves["w"]["shards"]] == [
        [[r, r + 4], [c, c + 2]] for r in (0, 4) for c in (0, 2, 4, 6)
    ]
    assert leaves["w"]["dtype"] == "bfloat16"
    # b is replicated on 8 devices: written once; ids [2, 4] over fsdp: 4 shards, each replicated twice
    assert [s["index"] for s in leaves["b"]["shards"]] == [[[0, 4]]]
    assert [s["index"] for s in leaves["ids"]["shards"]] == [[[0, 2], [i, i + 1]] for i in range(4)]
    assert leaves["ids"]["dtype"] == "int32"

    # a WeightPublisher continues the store with a delta against the sharded version
    cast = lambda t: {k: v.astype(ml_dtypes.bfloat16) if v.dtype.kind == "f" else v for k, v in t.items()}  # noqa: E731
    WeightPublisher(url).publish(cast(_tree(1)), 1)
    sub = WeightSubscriber(url)
    assert sub.manifest(1)["kind"] == "delta" and sub.manifest(1)["base_version"] == 0
    for v in (0, 1):
        got = sub.read(v, fallback=False)[1]
        for k, want in cast(_tree(v)).items():
            assert got[k].dtype == want.dtype and got[k].tobytes() == want.tobytes(), (v, k)
    part = read_shard(url, 0, "w", (slice(3, 7), slice(2, 5)))
    assert part.tobytes() == np.ascontiguousarray(cast(_tree(0))["w"][3:7, 2:5]).tobytes()
    with pytest.raises(WeightSyncError, match="is a 'delta' version .*read_shard reads versions written per shard"):
        read_shard(url, 1, "w", (slice(0, 1),))
    with pytest.raises(WeightSyncError, match=r"version=0; accepted: an int > latest version 1"):
        publish_sharded(url, _global(_tree(0), mesh), 0)


def test_per_shard_deltas_chain_and_rebase(tmp_path):
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    url = f"file://{tmp_path}/store"
    pub = ShardedWeightPublisher(url, new_base_fraction=1.5)
    trees = [_tree(0)]
    for v in range(1, 5):  # small updates: most bits of each version equal the one before
        prev = trees[-1]
        trees.append({**prev, "w": prev["w"] + np.float32(1e-3) * _tree(10 + v)["w"]})
    kinds = [pub.publish(_global(t, mesh), v)["kind"] for v, t in enumerate(trees)]
    sub = WeightSubscriber(url)
    manifests = [sub.manifest(v) for v in range(5)]
    # deltas until their stored bytes reach 1.5 x the snapshot's, then a new snapshot
    since, expect = 0, ["sharded"]
    for m in manifests[1:]:
        if since < 1.5 * manifests[[k for k, e in enumerate(expect) if e == "sharded"][-1]]["stored_bytes"]:
            expect.append("sharded_delta")
            since += m["stored_bytes"]
        else:
            expect.append("sharded")
            since = 0
    assert kinds == expect and "sharded_delta" in kinds
    # b and ids never change: their XOR shards are all zero and not stored at all
    for m in manifests[1:]:
        if m["kind"] == "sharded_delta":
            leaves = {lf["path"]: lf for lf in m["leaves"]}
            assert leaves["b"]["stored_bytes"] == leaves["ids"]["stored_bytes"] == leaves["step"]["stored_bytes"] == 0
            assert 0 < leaves["w"]["stored_bytes"]
    for v, t in enumerate(trees):
        got = WeightSubscriber(url).read(v, fallback=False)[1]  # a fresh reader: the whole chain
        for k in t:
            assert isinstance(got[k], np.ndarray) and got[k].shape == t[k].shape, (v, k)
            assert got[k].tobytes() == t[k].tobytes(), (v, k)
        part = read_shard(url, v, "w", (slice(1, 8), slice(3, 4)))
        assert part.tobytes() == np.ascontiguousarray(t["w"][1:8, 3:4]).tobytes(), v
    # a resharded tree cannot be a delta: a snapshot is written
    other = jax.make_mesh((4, 2), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    assert pub.publish(_global(trees[-1], other), 5)["kind"] == "sharded"
