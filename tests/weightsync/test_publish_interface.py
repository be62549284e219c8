"""The one publishing interface (`Publisher`): both publishers take the same call and return a
`PublishInfo`, the one-writer publisher copies device arrays to the host and casts them itself, and
`open_publisher` picks the publisher for a process count."""

from __future__ import annotations

from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec

from composer_jax.weightsync.publisher import WeightPublisher, open_publisher
from composer_jax.weightsync.sharded import ShardedWeightPublisher
from composer_jax.weightsync.store import Publisher, PublishInfo, WeightSyncError
from composer_jax.weightsync.subscriber import WeightSubscriber


def _host(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    return {
        "layer": {"w": rng.standard_normal((8, 4)).astype(np.float32)},
        "b": rng.standard_normal((4,)).astype(ml_dtypes.bfloat16),  # not a numpy floating type: kept
        "ids": rng.integers(0, 9, (8,)).astype(np.int32),
    }


def _on_mesh(tree: dict, mesh) -> dict:
    specs = {"w": PartitionSpec("data", "fsdp"), "b": PartitionSpec(), "ids": PartitionSpec("data")}

    def put(path: str, v: np.ndarray) -> jax.Array:
        return jax.make_array_from_callback(v.shape, NamedSharding(mesh, specs[path]), v.__getitem__)

    return {"layer": {"w": put("w", tree["layer"]["w"])}, "b": put("b", tree["b"]), "ids": put("ids", tree["ids"])}


def _cast(tree: dict, dtype) -> dict:
    return {
        k: _cast(v, dtype) if isinstance(v, dict) else (v.astype(dtype) if np.issubdtype(v.dtype, np.floating) else v)
        for k, v in tree.items()
    }


def _same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for k in want:
        if isinstance(want[k], dict):
            _same(got[k], want[k])
        else:
            assert got[k].dtype == want[k].dtype and got[k].tobytes() == want[k].tobytes(), k


@pytest.mark.parametrize("cls", [WeightPublisher, ShardedWeightPublisher])
def test_both_publishers_take_one_call_and_return_publish_info(tmp_path: Path, cls: type) -> None:
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    url = f"file://{tmp_path}/store"
    pub: Publisher = cls(url, new_base_fraction=10.0)
    infos = [pub.publish(_on_mesh(_host(v), mesh), v, dtype="bfloat16") for v in range(3)]
    assert all(isinstance(i, PublishInfo) for i in infos)
    assert [i.version for i in infos] == [0, 1, 2] and pub.latest == 2
    snapshot, delta = ("base", "delta") if cls is WeightPublisher else ("sharded", "sharded_delta")
    assert [i.kind for i in infos] == [snapshot, delta, delta]
    sub = WeightSubscriber(url)
    for i in infos:
        assert i.manifest == sub.manifest(i.version) and i["kind"] == i.kind
        assert i.base_version == 0 and i.raw_bytes == i.manifest["raw_bytes"]
        assert i.follower_bytes == i.stored_bytes > 0
        # the published copy is the host tree cast in numpy: float32 -> bfloat16, the rest as they are
        _same(sub.read(i.version, fallback=False)[1], _cast(_host(i.version), ml_dtypes.bfloat16))
    # force_base and the default version (latest + 1) are the same call on both
    forced = pub.publish(_on_mesh(_host(3), mesh), force_base=True)
    assert (forced.version, forced.kind) == (3, snapshot)
    with pytest.raises(WeightSyncError, match=r"dtype='int32'; accepted: '' \(as is\) or a floating dtype name"):
        pub.publish(_on_mesh(_host(4), mesh), dtype="int32")
    with pytest.raises(WeightSyncError, match=r"dtype='fp13'; accepted"):
        pub.publish(_on_mesh(_host(4), mesh), dtype="fp13")


def test_one_writer_publishes_numpy_and_device_trees_alike(tmp_path: Path) -> None:
    """A device tree (sharded over the 8 local devices) and its numpy copy, each cast to float32
    (bfloat16 kept: not a numpy floating type), give the same stored bits."""
    mesh = jax.make_mesh((2, 4), ("data", "fsdp"), axis_types=(AxisType.Auto,) * 2)
    host, device = WeightPublisher(f"file://{tmp_path}/h"), WeightPublisher(f"file://{tmp_path}/d")
    for v in range(2):
        a = host.publish(_host(v), v, dtype="float32")
        b = device.publish(_on_mesh(_host(v), mesh), v, dtype="float32")
        assert [lf["sha256"] for lf in a.manifest["leaves"]] == [lf["sha256"] for lf in b.manifest["leaves"]]
        assert (a.kind, a.stored_bytes) == (b.kind, b.stored_bytes)
    got = WeightSubscriber(f"file://{tmp_path}/d").read(1, fallback=False)[1]
    assert got["b"].dtype == ml_dtypes.bfloat16 and got["layer"]["w"].dtype == np.float32
    _same(got, _host(1))


def test_open_publisher_picks_by_process_count(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/store"
    assert isinstance(open_publisher(url), WeightPublisher)  # this test process: one process
    assert isinstance(open_publisher(url, process_count=1, new_base_fraction=2.0), WeightPublisher)
    several = open_publisher(url, process_count=2, new_base_fraction=2.0)
    assert isinstance(several, ShardedWeightPublisher) and several.new_base_fraction == 2.0
    with pytest.raises(WeightSyncError, match=r"process_count=0; accepted: an int >= 1"):
        open_publisher(url, process_count=0)
