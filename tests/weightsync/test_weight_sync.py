"""Weight sync through tensorstore (src/composer_jax/weightsync/: publisher.py, subscriber.py): bit-exact base and delta
round trips, new bases past the threshold, checksums, errors, and a subscriber in another process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import tensorstore as ts

from composer_jax.weightsync.publisher import WeightPublisher
from composer_jax.weightsync.store import WeightSyncError, tree_sha256
from composer_jax.weightsync.subscriber import WeightSubscriber

SRC = Path(__file__).resolve().parents[2] / "src"
BF16 = np.dtype(ml_dtypes.bfloat16)


def _special_f32() -> np.ndarray:
    bits = np.array([0x7FC00000, 0x7FC00123, 0xFFC00001, 0x7F800000, 0xFF800000, 0x80000000, 0, 1], np.uint32)
    return bits.view(np.float32)  # quiet NaNs with payloads, +-inf, -0.0, +0.0, a denormal


def _special_bf16() -> np.ndarray:
    return np.array([0x7FC0, 0x7FC1, 0xFFC3, 0x7F80, 0xFF80, 0x8000, 0, 1], np.uint16).view(BF16)


def _params(rng: np.random.Generator) -> dict:
    return {
        "embed": rng.standard_normal((64, 32)).astype(BF16),
        "layers": {
            "w": rng.standard_normal((4, 32, 48)).astype(np.float32),
            "norm": np.ones((32,), BF16),
            "special_f32": _special_f32(),
            "special_bf16": _special_bf16(),
        },
        "scale": np.float32(0.5),
    }


def _step(params: dict, rng: np.random.Generator, frac: float = 0.02, rel: float = 0.05) -> dict:
    """Change a fraction `frac` of the floating entries by `rel` relative; the NaN/inf/-0.0 leaves
    are rolled by one (so a delta XORs special bit patterns with each other)."""

    def upd(a: np.ndarray) -> np.ndarray:
        if a.ndim == 0:
            return a
        if a.size <= 8:
            return np.roll(a, 1)
        f = a.astype(np.float32)
        mask = rng.random(a.shape) < frac
        return np.where(mask, f * (1 + rel), f).astype(a.dtype)

    return {k: _step(v, rng, frac, rel) if isinstance(v, dict) else upd(v) for k, v in params.items()}


def _assert_bit_equal(a: dict, b: dict) -> None:
    assert tree_sha256(a) == tree_sha256(b)


def test_round_trip_base_and_deltas_bit_exact(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    url = f"file://{tmp_path}/store"
    pub = WeightPublisher(url, new_base_fraction=10.0)
    sub = WeightSubscriber(url)
    history = []
    p = _params(rng)
    for i in range(4):
        info = pub.publish(p)
        assert (info.version, info.kind, info.base_version) == (i, "base" if i == 0 else "delta", 0)
        history.append(p)
        v, got = sub.read()
        assert v == i
        _assert_bit_equal(got, p)
        assert got["embed"].dtype == BF16 and got["layers"]["w"].dtype == np.float32 and got["scale"].shape == ()
        p = _step(p, rng)
    fresh = WeightSubscriber(url)  # reading old versions out of order, with no cache
    for i in (2, 0, 3, 1):
        _assert_bit_equal(fresh.read(i)[1], history[i])
    m = fresh.manifest(2)
    assert m["kind"] == "delta" and m["base_version"] == 0
    leaf = next(lf for lf in m["leaves"] if lf["path"] == "embed")
    assert leaf["dtype"] == "bfloat16" and leaf["shape"] == [64, 32] and len(leaf["sha256"]) == 64
    assert leaf["stored_bytes"] > 0 and leaf["raw_bytes"] == 64 * 32 * 2


def test_jax_bf16_leaves_and_sparse_delta_is_small(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    w = rng.standard_normal((256, 256)).astype(BF16)
    url = f"file://{tmp_path}/s"
    pub = WeightPublisher(url)
    base = pub.publish({"w": jnp.asarray(w)})
    w2 = _step({"w": w}, rng, frac=0.01, rel=0.05)["w"]
    delta = pub.publish({"w": jnp.asarray(w2)})
    assert delta.kind == "delta"
    print(f"raw {delta.raw_bytes} B, base stored {base.stored_bytes} B, delta stored {delta.stored_bytes} B")
    assert delta.stored_bytes < 0.2 * delta.raw_bytes
    got = WeightSubscriber(url).read()[1]["w"]
    np.testing.assert_array_equal(got.view(np.uint16), w2.view(np.uint16))


def test_new_base_after_threshold(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    url = f"file://{tmp_path}/s"
    pub = WeightPublisher(url, new_base_fraction=0.3)
    p = _params(rng)
    kinds = []
    for i in range(6):
        if i:
            p = _step(p, rng, frac=0.5, rel=0.3)  # dense change: each delta is a large share of the base
        info = pub.publish(p)
        kinds.append((info.kind, info.version))
    assert kinds[0] == ("base", 0) and kinds[1][0] == "delta"
    bases = [v for k, v in kinds if k == "base"]
    assert len(bases) >= 2, kinds
    sub = WeightSubscriber(url)
    for v in range(6):
        m = sub.manifest(v)
        assert m["base_version"] == max(b for b in bases if b <= v)
    _assert_bit_equal(sub.read()[1], p)
    # A reopened publisher continues after the latest version, against the same base.
    pub2 = WeightPublisher(url, new_base_fraction=100.0)
    p = _step(p, rng)
    info = pub2.publish(p)
    assert info.version == 6 and info.kind == "delta" and info.base_version == bases[-1]
    _assert_bit_equal(sub.read(6)[1], p)


def test_memory_url_with_shared_context() -> None:
    ctx = ts.Context()
    p = _params(np.random.default_rng(3))
    pub = WeightPublisher("memory://ws/", context=ctx)
    pub.publish(p)
    pub.publish(_step(p, np.random.default_rng(4)))
    v, got = WeightSubscriber("memory://ws/", context=ctx).read()
    assert v == 1
    _assert_bit_equal(got, _step(p, np.random.default_rng(4)))


def test_corrupt_chunk_detected(tmp_path: Path) -> None:
    rng = np.random.default_rng(5)
    url = f"file://{tmp_path}/s"
    pub = WeightPublisher(url)
    p = _params(rng)
    pub.publish(p)
    pub.publish(_step(p, rng))
    m = WeightSubscriber(url).manifest(1)
    i = next(j for j, lf in enumerate(m["leaves"]) if lf["path"] == "layers/w")
    # A valid, well-compressed chunk with the wrong bits: only the checksum can tell.
    arr = ts.open({"driver": "zarr3", "kvstore": f"{url}/versions/00000001/leaves/{i}/"}).result()
    bits = arr.read().result()
    bits[0, 0, 0] ^= 1
    arr.write(bits).result()
    with pytest.raises(WeightSyncError, match=r"checksum mismatch for leaf 'layers/w' of version 1"):
        WeightSubscriber(url).read(1, fallback=False)
    # Garbage in the chunk file itself: a read error naming the leaf and version.
    chunk = next(
        f
        for f in (tmp_path / "s" / "versions" / "00000001" / "leaves" / str(i)).rglob("*")
        if f.is_file() and f.name != "zarr.json"
    )
    chunk.write_bytes(b"not zstd at all")
    with pytest.raises(WeightSyncError, match=r"leaf 'layers/w' of version 1"):
        WeightSubscriber(url).read(fallback=False)
    # The base is untouched and still reads.
    _assert_bit_equal(WeightSubscriber(url).read(0)[1], p)


def test_corrupt_manifest_checksum_detected(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/s"
    WeightPublisher(url).publish(_params(np.random.default_rng(6)))
    path = tmp_path / "s" / "versions" / "00000000" / "manifest.json"
    m = json.loads(path.read_text())
    m["leaves"][0]["sha256"] = "0" * 64
    path.write_text(json.dumps(m))
    with pytest.raises(WeightSyncError, match=rf"checksum mismatch for leaf '{m['leaves'][0]['path']}' of version 0"):
        WeightSubscriber(url, retry_delay_s=0).read()
    path.write_text("{not json")
    with pytest.raises(WeightSyncError, match="not valid JSON"):
        WeightSubscriber(url, retry_delay_s=0).read(0)


def test_errors_empty_store_unknown_version_and_arguments(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/s"
    with pytest.raises(WeightSyncError, match=r"is empty.*versions present: none"):
        WeightSubscriber(url).read()
    with pytest.raises(WeightSyncError, match=r"version 3 is not in .*none \(empty store\)"):
        WeightSubscriber(url).read(3)
    pub = WeightPublisher(url)
    pub.publish({"w": np.zeros((2,), np.float32)})
    pub.publish({"w": np.ones((2,), np.float32)})
    with pytest.raises(WeightSyncError, match=r"version 7 is not in .*\[0, 1\]"):
        WeightSubscriber(url).read(7)
    with pytest.raises(WeightSyncError, match=r"version=1; accepted: an int > latest version 1"):
        pub.publish({"w": np.ones((2,), np.float32)}, version=1)
    with pytest.raises(WeightSyncError, match=r"new_base_fraction=0; accepted: a number > 0"):
        WeightPublisher(url, new_base_fraction=0)
    with pytest.raises(WeightSyncError, match=r"zstd_level=99"):
        WeightPublisher(url, zstd_level=99)
    with pytest.raises(WeightSyncError, match=r"url 'some/dir' is not a kvstore URL"):
        WeightPublisher("some/dir")
    with pytest.raises(WeightSyncError, match=r"pytree node at 'a' is a list"):
        pub.publish({"a": [np.zeros(2)]})
    with pytest.raises(WeightSyncError, match=r"leaf 'c' has dtype complex128 of itemsize 16"):
        pub.publish({"c": np.zeros(2, np.complex128)})


def test_changed_layout_writes_a_base(tmp_path: Path) -> None:
    url = f"file://{tmp_path}/s"
    pub = WeightPublisher(url)
    pub.publish({"w": np.zeros((2,), np.float32)})
    info = pub.publish({"w": np.zeros((3,), np.float32)})
    assert info.kind == "base" and info.base_version == 1
    _assert_bit_equal(WeightSubscriber(url).read()[1], {"w": np.zeros((3,), np.float32)})


def test_subscriber_in_another_process(tmp_path: Path) -> None:
    rng = np.random.default_rng(7)
    url = f"file://{tmp_path}/s"
    pub = WeightPublisher(url)
    p = _params(rng)
    pub.publish(p)
    p = _step(p, rng)
    pub.publish(p)
    code = (
        "import sys; from composer_jax.weightsync.store import tree_sha256; "
        "from composer_jax.weightsync.subscriber import WeightSubscriber; "
        "v, t = WeightSubscriber(sys.argv[1]).read(); print(v, tree_sha256(t))"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""), "JAX_PLATFORMS": "cpu"}
    out = subprocess.run(
        [sys.executable, "-c", code, url], capture_output=True, text=True, env=env, timeout=60, check=True
    )
    assert out.stdout.split() == ["1", tree_sha256(p)]


def test_rewind_forgets_a_lost_lineage_and_republishes_its_numbers(tmp_path: Path) -> None:
    """A trainer restarted from version 1's checkpoint rewinds the store: versions 2 and 3 (its
    lost run's) go, and the new 2 and 3 read back bit-exactly, for a subscriber that never saw the
    lost ones and for one reopened after the rewind."""
    rng = np.random.default_rng(3)
    url = f"file://{tmp_path}/store"
    pub = WeightPublisher(url, new_base_fraction=10.0)
    lineage = [_params(rng)]
    for _ in range(3):
        lineage.append(_step(lineage[-1], rng))
    for p in lineage:
        pub.publish(p)
    reopened = WeightPublisher(url, new_base_fraction=10.0)  # the restarted trainer's publisher
    with pytest.raises(WeightSyncError, match=r"rewind to version=7; accepted: a version in the store \[0, 1, 2, 3\]"):
        reopened.rewind(7)
    assert reopened.rewind(1) == [2, 3]
    assert reopened.latest == 1 and WeightSubscriber(url).versions() == [0, 1]
    assert WeightSubscriber(url).latest_version() == 1
    assert reopened.rewind(1) == []
    new = [lineage[1]]
    for _ in range(2):
        new.append(_step(new[-1], rng, frac=0.3))
    for v, p in enumerate(new[1:], start=2):
        info = reopened.publish(p, v)
        assert (info.kind, info.base_version) == ("delta", 0)
    sub = WeightSubscriber(url)
    for v, p in enumerate(new[1:], start=2):
        got_v, got = sub.read(v, fallback=False)
        assert got_v == v
        _assert_bit_equal(got, p)
    assert tree_sha256(new[2]) != tree_sha256(lineage[3])
    assert WeightPublisher(url).latest == 3
