"""Weight-sync fallback: a corrupted or missing delta, base chunk or manifest is caught by the checks,
read again, and otherwise replaced by the newest earlier version that reads (weightsync/subscriber.py)."""

from __future__ import annotations

import shutil
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts

from composer_jax.weightsync import subscriber
from composer_jax.weightsync.publisher import WeightPublisher
from composer_jax.weightsync.store import WeightSyncError, tree_sha256
from composer_jax.weightsync.subscriber import WeightSubscriber

BF16 = np.dtype(ml_dtypes.bfloat16)


def _versions(n: int, seed: int = 0) -> list[dict]:
    """n parameter trees, each a small step from the one before (bf16 and float32 leaves)."""
    rng = np.random.default_rng(seed)
    p: dict = {
        "embed": rng.standard_normal((16, 8)).astype(BF16),
        "blk": {"w": rng.standard_normal((8, 8)).astype(np.float32)},
    }
    out: list[dict] = [p]
    for _ in range(n - 1):
        q = out[-1]
        out.append(
            {
                "embed": (q["embed"].astype(np.float32) * (1 + 0.05 * (rng.random((16, 8)) < 0.1))).astype(BF16),
                "blk": {"w": q["blk"]["w"] + np.float32(0.01) * (rng.random((8, 8)) < 0.1)},
            }
        )
    return out


MODES = pytest.mark.parametrize("mode", ["previous", "base"])


def _publish(url: str, trees: list[dict], force_base: tuple[int, ...] = (), mode: str = "previous") -> None:
    pub = WeightPublisher(url, new_base_fraction=1e9, delta_against=mode)
    for v, t in enumerate(trees):
        pub.publish(t, v, force_base=v in force_base)


def _leaf_dir(root: Path, version: int, path: str) -> Path:
    m = WeightSubscriber(f"file://{root}").manifest(version)
    i = next(j for j, lf in enumerate(m["leaves"]) if lf["path"] == path)
    return root / "versions" / f"{version:08d}" / "leaves" / str(i)


def _flip_bit(root: Path, version: int, path: str) -> None:
    """Rewrite the leaf as a valid zarr array with one bit flipped: only the sha256 can tell."""
    arr = ts.open({"driver": "zarr3", "kvstore": f"file://{_leaf_dir(root, version, path)}/"}).result()
    bits = arr.read().result()
    bits.reshape(-1)[3] ^= 1
    arr.write(bits).result()


def _chunks(root: Path, version: int, path: str) -> list[Path]:
    return [f for f in _leaf_dir(root, version, path).rglob("*") if f.is_file() and f.name != "zarr.json"]


@MODES
def test_corrupted_delta_falls_back_to_the_version_before(tmp_path: Path, mode: str) -> None:
    root, trees = tmp_path / "s", _versions(4)
    _publish(f"file://{root}", trees, mode=mode)
    _flip_bit(root, 3, "blk/w")
    sub = WeightSubscriber(f"file://{root}", retry_delay_s=0)
    with pytest.raises(WeightSyncError, match=r"checksum mismatch for leaf 'blk/w' of version 3"):
        sub.read(fallback=False)
    v, got = sub.read()
    assert v == 2 and tree_sha256(got) == tree_sha256(trees[2])
    assert sub.last_fallback is not None
    assert "read version 2 instead" in sub.last_fallback and "'blk/w' of version 3" in sub.last_fallback
    # an intact version read afterwards reports no fallback
    assert sub.read(1)[0] == 1 and sub.last_fallback is None


@MODES
def test_deleted_delta_chunk_and_manifest_fall_back(tmp_path: Path, mode: str) -> None:
    root, trees = tmp_path / "s", _versions(4, seed=1)
    _publish(f"file://{root}", trees, mode=mode)
    for f in _chunks(root, 3, "embed"):
        f.unlink()
    (root / "versions" / "00000002" / "manifest.json").unlink()
    sub = WeightSubscriber(f"file://{root}", retry_delay_s=0)
    v, got = sub.read()  # 3 lacks a chunk (reads as fill value 0: checksum), 2 lacks its manifest
    assert v == 1 and tree_sha256(got) == tree_sha256(trees[1])
    # a chain meets the missing parent 2 first; a star (deltas on the base) reads 3's leaves first
    first = "version 2 is not in" if mode == "previous" else "'embed' of version 3"
    assert first in (sub.last_fallback or "")


def test_retry_reads_the_same_version_when_the_store_recovers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root, trees = tmp_path / "s", _versions(3, seed=2)
    _publish(f"file://{root}", trees)
    leaf = _leaf_dir(root, 2, "embed")
    saved = tmp_path / "saved"
    shutil.copytree(leaf, saved)
    for f in _chunks(root, 2, "embed"):
        f.write_bytes(b"half a chunk")  # as if read while a writer was replacing it
    waits: list[float] = []

    def writer_finishes(seconds: float) -> None:  # the subscriber's pause before its second try
        waits.append(seconds)
        shutil.rmtree(leaf)
        shutil.copytree(saved, leaf)

    monkeypatch.setattr(subscriber.time, "sleep", writer_finishes)
    sub = WeightSubscriber(f"file://{root}", retry_delay_s=0.5)
    v, got = sub.read()
    assert waits == [0.5]
    assert v == 2 and tree_sha256(got) == tree_sha256(trees[2])
    assert "second try" in (sub.last_fallback or "")


@MODES
def test_corrupted_base_chunk_falls_back_past_its_deltas(tmp_path: Path, mode: str) -> None:
    # versions 0 (base), 1 (delta on 0), 2 (base), 3, 4 (deltas after 2)
    root, trees = tmp_path / "s", _versions(5, seed=3)
    _publish(f"file://{root}", trees, force_base=(2,), mode=mode)
    assert WeightSubscriber(f"file://{root}").manifest(4)["base_version"] == 2
    _flip_bit(root, 2, "embed")
    sub = WeightSubscriber(f"file://{root}", retry_delay_s=0)
    v, got = sub.read(4)
    assert v == 1 and tree_sha256(got) == tree_sha256(trees[1])
    assert "'embed' of version 2" in (sub.last_fallback or "")


def test_nothing_readable_raises_naming_version_and_leaf(tmp_path: Path) -> None:
    root, trees = tmp_path / "s", _versions(3, seed=4)
    _publish(f"file://{root}", trees)
    _flip_bit(root, 0, "blk/w")  # the only base: every version depends on it
    sub = WeightSubscriber(f"file://{root}", retry_delay_s=0)
    with pytest.raises(
        WeightSyncError, match=r"version 2 failed twice and no earlier version reads: .*'blk/w' of version 0"
    ):
        sub.read()


def test_retry_delay_checked() -> None:
    with pytest.raises(WeightSyncError, match=r"retry_delay_s=-1; accepted: a number >= 0"):
        WeightSubscriber("memory://x/", retry_delay_s=-1)


@MODES
def test_chain_and_star_deltas_round_trip_through_late_joiners_and_reopen(tmp_path: Path, mode: str) -> None:
    url, trees = f"file://{tmp_path}/s", _versions(7, seed=5)
    pub = WeightPublisher(url, new_base_fraction=1e9, delta_against=mode)
    for v in range(4):
        pub.publish(trees[v], v)
    pub = WeightPublisher(url, new_base_fraction=1e9, delta_against=mode)  # a restarted trainer continues
    for v in range(4, 7):
        pub.publish(trees[v], v)
    sub = WeightSubscriber(url)
    parents = [sub.manifest(v)["parent_version"] for v in range(1, 7)]
    assert parents == ([0, 1, 2, 3, 4, 5] if mode == "previous" else [0] * 6)
    follower = WeightSubscriber(url)
    for v in range(7):  # one that follows every version, and late joiners at every version
        assert tree_sha256(follower.read(v)[1]) == tree_sha256(trees[v])
        assert tree_sha256(WeightSubscriber(url).read(v)[1]) == tree_sha256(trees[v])
    assert tree_sha256(follower.read(2)[1]) == tree_sha256(trees[2])  # going back reads from the base
    with pytest.raises(WeightSyncError, match=r"delta_against='next'; accepted: 'previous' or 'base'"):
        WeightPublisher(url, delta_against="next")


def test_a_follower_reads_the_delta_beside_a_new_base(tmp_path: Path) -> None:
    root, trees = tmp_path / "s", _versions(4, seed=6)
    url = f"file://{root}"
    pub = WeightPublisher(url, new_base_fraction=1e9)
    infos = [pub.publish(t, v, force_base=v == 2) for v, t in enumerate(trees)]
    assert infos[2].kind == "base" and 0 < infos[2].follower_bytes < infos[2].stored_bytes
    assert infos[3].follower_bytes == infos[3].stored_bytes
    follower = WeightSubscriber(url, retry_delay_s=0)
    follower.read(1)
    before = follower.bytes_read
    assert tree_sha256(follower.read(2)[1]) == tree_sha256(trees[2])
    assert follower.bytes_read - before == infos[2].follower_bytes  # the delta, not the base
    late = WeightSubscriber(url)
    assert tree_sha256(late.read(3)[1]) == tree_sha256(trees[3])
    assert late.bytes_read == infos[2].stored_bytes + infos[3].stored_bytes  # the base, then 3's delta
    # a bad delta beside the base: the retry reads the base itself
    follower2 = WeightSubscriber(url, retry_delay_s=0)
    follower2.read(1)
    arr = ts.open({"driver": "zarr3", "kvstore": f"{url}/versions/00000002/delta/0/"}).result()
    bits = arr.read().result()
    bits.reshape(-1)[0] ^= 1
    arr.write(bits).result()
    v, got = follower2.read(2)
    assert v == 2 and tree_sha256(got) == tree_sha256(trees[2]) and "second try" in (follower2.last_fallback or "")
