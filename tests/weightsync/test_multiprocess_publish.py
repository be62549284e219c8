"""Weight publishing from a real two-process JAX job (CPU collectives over gloo), read back here.

The worker (publish_worker.py) publishes the same two versions through the RL trainer's gather path
(`published_copy`, process 0's `WeightPublisher`) and per shard (`publish_sharded`). Both stores must
read back bit-exactly equal to a single-process `WeightPublisher` store of the same numpy tree
(the reference: the tree built in numpy, cast in numpy).
"""

from __future__ import annotations

import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from support.multiprocess_launch import free_port, run_processes
from support.publish_worker import (
    EXPORT_SEED,
    EXPORT_SHARD_SIZE,
    PUBLISH_DTYPE,
    export_model_config,
    publish_tree,
    quick_tree,
)

from composer_jax.weightsync.publisher import WeightPublisher
from composer_jax.weightsync.store import WeightSyncError, tree_sha256
from composer_jax.weightsync.subscriber import WeightSubscriber, read_shard


def _cast(tree: dict) -> dict:
    return {
        k: _cast(v) if isinstance(v, dict) else (v.astype(ml_dtypes.bfloat16) if v.dtype.kind == "f" else v)
        for k, v in tree.items()
    }


def _assert_bits_equal(a: dict, b: dict, where: str) -> None:
    assert sorted(a) == sorted(b), where
    for k in a:
        if isinstance(a[k], dict):
            _assert_bits_equal(a[k], b[k], f"{where}/{k}")
            continue
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, (where, k)
        assert a[k].tobytes() == b[k].tobytes(), (where, k)


def _run_workers(args: list[list[str]]) -> list[str]:
    """Both worker processes at once; none left running whatever happens."""
    worker = str(Path(__file__).resolve().parents[1] / "support" / "publish_worker.py")
    return run_processes([[sys.executable, worker, *a] for a in args], timeout=300)


def test_two_processes_publish_their_own_shards(tmp_path):
    """The quick two-process check (default suite): each process writes its half, read back whole."""
    url = f"file://{tmp_path / 'store'}"
    port = str(free_port())
    _run_workers([["quick", str(i), port, url] for i in range(2)])
    sub = WeightSubscriber(url)
    assert [sub.manifest(v)["kind"] for v in (0, 1)] == ["sharded", "sharded_delta"]
    # w [8, 4] over (data, fsdp): rows 0-3 live on process 0's devices, rows 4-7 on process 1's
    shards = sub.manifest(1)["leaves"][0]["shards"]
    assert [(s["index"][0], s["process"]) for s in shards] == [([0, 4], 0), ([0, 4], 0), ([4, 8], 1), ([4, 8], 1)]
    for v in (0, 1):
        got = sub.read(v, fallback=False)[1]["w"]
        assert got.dtype == np.float32 and got.tobytes() == quick_tree(v).tobytes()


@pytest.fixture(scope="module")
def stores(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("stores")
    urls = {name: f"file://{root / name}" for name in ("gathered", "sharded", "single")}
    urls["hf"] = str(root / "hf")
    urls["trainer"] = f"file://{root / 'trainer'}"
    port = str(free_port())
    outs = _run_workers(
        [[str(i), port, urls["gathered"], urls["sharded"], urls["hf"], urls["trainer"]] for i in range(2)]
    )
    assert "weight store rewound to version 1: versions [2] were of the lost run" in outs[0]
    single = WeightPublisher(urls["single"])
    for version in (0, 1):
        single.publish(_cast(publish_tree(version)), version)
    return urls


@pytest.mark.slow
def test_two_process_publishes_read_back_as_the_single_process_one(stores):
    for version in (0, 1):
        want = _cast(publish_tree(version))
        reads = {
            name: WeightSubscriber(url).read(version, fallback=False)
            for name, url in stores.items()
            if name not in ("hf", "trainer")
        }
        for name, (v, tree) in reads.items():
            assert v == version
            _assert_bits_equal(tree, want, f"{name} v{version}")
        assert len({tree_sha256(t) for _, t in reads.values()}) == 1
    assert WeightSubscriber(stores["gathered"]).manifest(1)["kind"] == "delta"  # process 0 kept its chain


@pytest.mark.slow
def test_the_rl_trainers_two_process_publish_and_rewind(stores):
    sub = WeightSubscriber(stores["trainer"])
    assert sub.versions() == [0, 1, 2] and sub.latest_version() == 2
    assert [sub.manifest(v)["kind"] for v in (0, 1, 2)] == ["sharded", "sharded_delta", "sharded"]
    for version, tree in ((0, 0), (1, 1), (2, 3)):  # version 2 was published anew after the rewind
        _assert_bits_equal(sub.read(version, fallback=False)[1], _cast(publish_tree(tree)), f"trainer v{version}")


@pytest.mark.slow
def test_sharded_store_is_written_per_shard_by_its_holder(stores):
    manifest = WeightSubscriber(stores["sharded"]).manifest(1)
    assert manifest["kind"] == "sharded_delta" and manifest["parent_version"] == 0
    assert WeightSubscriber(stores["sharded"]).manifest(0)["kind"] == "sharded"
    m = {lf["path"]: lf for lf in manifest["leaves"]}
    assert m["embed"]["dtype"] == PUBLISH_DTYPE and m["counts"]["dtype"] == "int32"
    # embed [8, 6] over (data, fsdp): 4 shards of [4, 3]; the data axis spans the processes
    assert [(s["index"], s["process"]) for s in m["embed"]["shards"]] == [
        ([[0, 4], [0, 3]], 0),
        ([[0, 4], [3, 6]], 0),
        ([[4, 8], [0, 3]], 1),
        ([[4, 8], [3, 6]], 1),
    ]
    # norm is replicated over data: only the holder of replica 0 (process 0) writes each shard
    assert [(s["index"], s["process"]) for s in m["norm"]["shards"]] == [([[0, 4], [0, 4]], 0), ([[4, 8], [0, 4]], 0)]
    assert [(s["index"], s["process"]) for s in m["scale"]["shards"]] == [([[0, 5]], 0)]
    assert [s["index"] for s in m["layer/w"]["shards"]] == [[[0, 6], [2 * i, 2 * i + 2]] for i in range(4)]

    # a reader asking for a slice gets exactly it, from the shards it overlaps (snapshot XOR delta)
    want = _cast(publish_tree(1))
    got = read_shard(stores["sharded"], 1, "layer/w", (slice(1, 5), slice(1, 6)))
    assert got.tobytes() == np.ascontiguousarray(want["layer"]["w"][1:5, 1:6]).tobytes()
    with pytest.raises(WeightSyncError, match="no leaf 'nope'"):
        read_shard(stores["sharded"], 1, "nope", (slice(0, 1),))


@pytest.mark.slow
def test_a_corrupted_shard_is_detected(stores, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(stores["sharded"][len("file://") :], copy)
    url = f"file://{copy}"
    manifest = WeightSubscriber(url).manifest(1)
    lf = next(x for x in manifest["leaves"] if x["path"] == "embed")
    lf["shards"][2]["sha256"] = "0" * 64
    (copy / "versions" / "00000001" / "manifest.json").write_text(__import__("json").dumps(manifest))
    with pytest.raises(WeightSyncError, match=r"checksum mismatch for shard \[\[4, 8\], \[0, 3\]\] of leaf 'embed'"):
        WeightSubscriber(url).read(1, fallback=False)
    with pytest.raises(WeightSyncError, match="checksum mismatch"):
        read_shard(url, 1, "embed", (slice(5, 6),))
    # a manifest format this reader does not know is refused by name
    manifest["format"] = 9
    (copy / "versions" / "00000001" / "manifest.json").write_text(__import__("json").dumps(manifest))
    with pytest.raises(WeightSyncError, match="has format 9; this reader knows formats"):
        WeightSubscriber(url).read(1, fallback=False)


@pytest.mark.slow
def test_two_process_hf_export_equals_the_single_process_one(stores, tmp_path):
    import jax

    from composer_jax.hf.weights import save_pretrained
    from composer_jax.model.params import init_params

    cfg = export_model_config(4)  # the model section only: no mesh is built here
    params = init_params(cfg.model, jax.random.key(EXPORT_SEED))  # one device: init is keyed by path, not mesh
    single = save_pretrained(params, cfg.model, tmp_path / "single", max_shard_size=EXPORT_SHARD_SIZE)
    two = Path(stores["hf"])
    names = sorted(p.name for p in single.iterdir())
    assert len([n for n in names if n.endswith(".safetensors")]) > 1  # the sharded-files path
    assert sorted(p.name for p in two.iterdir()) == names
    for name in names:
        assert (two / name).read_bytes() == (single / name).read_bytes(), name
