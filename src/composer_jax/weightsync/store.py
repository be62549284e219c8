"""Weight sync through a tensorstore kvstore: base snapshots plus compressed XOR deltas.

Both publishers, this module's `WeightPublisher` (one writer) and
`weightsync/sharded.py`'s `ShardedWeightPublisher` (every process of a multi-host trainer
its own shards), are a `Publisher`: `publish(params, version, *, dtype=...) -> PublishInfo`, so a
trainer opens one (`sharded_publish.open_publisher`) and calls it the same way in both cases.

A `WeightPublisher` writes each policy version of a parameter pytree (nested dicts of arrays) to a
kvstore given by URL (``file://DIR`` by default, or any tensorstore kvstore URL: ``gs://``,
``s3://``, ``memory://``). A version is either a *base* (the raw bit patterns of every leaf) or a
*delta* against a parent version: the bit patterns viewed as same-width unsigned ints XOR-ed with the
parent's. The parent is the previous version (`delta_against="previous"`, the default: a chain of
deltas back to the latest base, each as small as one step's change) or the latest base
(`delta_against="base"`: one delta to read after the base, but it grows with every step since the
base). Both are stored as zarr3 arrays with the zstd codec, so a small update (most bits equal)
compresses well. Layout under the URL::

    versions/00000007/manifest.json       version, kind, base_version, parent_version, leaves (path,
                                          dtype, shape, sha256 of the reconstructed bytes, stored_bytes)
    versions/00000007/leaves/<i>/...      one zarr3 array per leaf (uint bits or XOR bits)
    latest                                {"version": 7}, written last

A version written by every process of a multi-host trainer, each its own shards (manifest format 2,
kind "sharded", or "sharded_delta" XOR-ed shard by shard with its parent: per-shard index ranges
and sha256s), is read the same way (checkpoint/
sharded_publish.py); a manifest of a format this module does not know is refused by name.

The manifest is written after every leaf and ``latest`` after the manifest, so a reader that
follows ``latest`` never sees a half-written version. A new base is written once the stored bytes of
the deltas since the latest base reach ``new_base_fraction`` of the base's stored bytes (which also
bounds what a subscriber joining late reads: the base plus at most that fraction of it).

A `WeightSubscriber` (in any process or host) reads the latest or a given version and reconstructs
the pytree bit-exactly, checking every leaf's sha256 (`WeightSyncError` names the leaf and version);
a version that fails its checks is read again (base included), then the newest earlier version that
reads is returned instead (`WeightSubscriber` docstring).

It lives in `checkpoint/` (a storage format) so that both the RL publisher and the serve side,
which sits below `rl/`, can use it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import ml_dtypes
import numpy as np
import tensorstore as ts

_UINT: dict[int, np.dtype[Any]] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.uint16),
    4: np.dtype(np.uint32),
    8: np.dtype(np.uint64),
}
_VERSION_RE = re.compile(r"^versions/(\d{8})/manifest\.json$")
_CHUNK_BYTES = 16 << 20
# manifest formats: 1 = one writer, whole leaves (base / delta); 2 = adds kind "sharded" (every
# trainer process writes its own shards: weightsync/sharded.py)
SHARDED_FORMAT = 2
_FORMATS = (1, SHARDED_FORMAT)


class WeightSyncError(ValueError):
    """A weight-sync store is empty, lacks a version, or holds data that fails its checksum."""


@dataclass(frozen=True)
class PublishInfo:
    """What a `Publisher.publish` wrote: the version, its kind ("base" / "delta" from a
    `WeightPublisher`, "sharded" / "sharded_delta" from a `ShardedWeightPublisher`), and raw vs
    stored bytes. follower_bytes: what a subscriber holding the previous version reads to get this
    one (the delta; for a base written with a delta beside it, that delta; else the base).
    manifest: the version's manifest as written; `info[key]` is `info.manifest[key]` (the sharded
    publisher returned the manifest itself before both returned a PublishInfo)."""

    version: int
    kind: str
    base_version: int
    raw_bytes: int
    stored_bytes: int
    follower_bytes: int = 0
    manifest: dict[str, Any] = dataclasses.field(default_factory=dict, repr=False, compare=False)

    def __getitem__(self, key: str) -> Any:
        return self.manifest[key]


class Publisher(Protocol):
    """A writer of policy versions to a weight-sync store (`WeightPublisher`: one process writes
    whole leaves; `ShardedWeightPublisher`: every process of a multi-host trainer writes the shards
    it holds). `latest`: the newest version in the store (None: empty)."""

    latest: int | None

    def publish(
        self, params: Any, version: int | None = None, *, dtype: str = "", force_base: bool = False
    ) -> PublishInfo:
        """Write `params` as `version` (default: latest + 1, or 0), floating leaves cast to `dtype`
        first ("" = as is), and point `latest` at it. `force_base`: a snapshot, not a delta."""
        ...


def publish_dtype(dtype: str) -> np.dtype | None:
    """The dtype `publish(..., dtype=)` casts floating leaves to (None for "": as is), or a
    WeightSyncError naming the value. Floating means numpy's floating kinds; ml_dtypes' (bfloat16,
    float8_*) are not numpy floating types and stay as they are."""
    if dtype == "":
        return None
    try:
        out = _dtype_from_name(dtype) if isinstance(dtype, str) else None
        if out is not None:
            ml_dtypes.finfo(out)  # a floating type (numpy's or ml_dtypes')
    except (WeightSyncError, TypeError, ValueError):
        out = None
    if out is None:
        raise WeightSyncError(
            f"dtype={dtype!r}; accepted: '' (as is) or a floating dtype name such as 'bfloat16', 'float32'"
        )
    return out


def _dtype_from_name(name: str) -> np.dtype:
    try:
        return np.dtype(name)
    except TypeError:
        pass
    dt = getattr(ml_dtypes, name, None)
    if dt is None:
        raise WeightSyncError(f"unknown dtype {name!r} in a weight-sync manifest")
    return np.dtype(dt)


_T = TypeVar("_T")


def flatten_tree(
    tree: Any, leaf: Callable[[str, Any], _T | None], accepted: str, prefix: str = ""
) -> list[tuple[str, _T]]:
    """The leaves of a tree of nested dicts as ("a/b/c", leaf(path, node)) pairs in key order. Keys
    must be non-empty str without '/'; `leaf` returns None for a node it does not accept, which is
    refused naming `accepted`."""
    if isinstance(tree, dict):
        out: list[tuple[str, _T]] = []
        for k in sorted(tree):
            if not isinstance(k, str) or not k or "/" in k:
                raise WeightSyncError(
                    f"pytree key {k!r} at {prefix or '<root>'!r}: keys must be non-empty str without '/'"
                )
            out += flatten_tree(tree[k], leaf, accepted, f"{prefix}/{k}" if prefix else k)
        return out
    value = leaf(prefix, tree)
    if value is None:
        raise WeightSyncError(f"pytree node at {prefix or '<root>'!r} is a {type(tree).__name__}; accepted: {accepted}")
    return [(prefix, value)]


def _host_leaf(path: str, node: Any, cast: np.dtype | None = None) -> np.ndarray | None:
    if not (hasattr(node, "shape") and hasattr(node, "dtype")):
        return None
    if getattr(node, "is_fully_addressable", True) is False:
        raise WeightSyncError(
            f"leaf {path!r} is an array over several processes, which one writer cannot gather; publish it "
            "with a ShardedWeightPublisher (weightsync/sharded.py, `open_publisher` picks it)"
        )
    arr = np.asarray(node, order="C")  # a jax.Array: copied to the host (this process holds all of it)
    if cast is not None and np.issubdtype(arr.dtype, np.floating):
        arr = np.asarray(arr.astype(cast), order="C")
    if arr.dtype.itemsize not in _UINT:
        raise WeightSyncError(
            f"leaf {path!r} has dtype {arr.dtype} of itemsize {arr.dtype.itemsize}; accepted itemsizes: 1, 2, 4, 8"
        )
    return arr


def _flatten(tree: Any, cast: np.dtype | None = None) -> list[tuple[str, np.ndarray]]:
    return flatten_tree(tree, lambda path, node: _host_leaf(path, node, cast), "dict or array")


def _unflatten(leaves: dict[str, np.ndarray]) -> dict:
    root: dict = {}
    for path, arr in leaves.items():
        node = root
        *parents, last = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = arr
    return root


def _bits(arr: np.ndarray) -> np.ndarray:
    return arr.view(_UINT[arr.dtype.itemsize])


def _sha256(arr: np.ndarray) -> str:
    return hashlib.sha256(np.asarray(arr, order="C").tobytes()).hexdigest()


def _vdir(version: int) -> str:
    return f"versions/{version:08d}/"


def _base_url(url: str) -> str:
    if not isinstance(url, str) or "://" not in url:
        raise WeightSyncError(
            f"weight-sync url {url!r} is not a kvstore URL; accepted: file://DIR, memory://, "
            "gs://BUCKET/PATH, s3://BUCKET/PATH or any tensorstore kvstore URL"
        )
    return url if url.endswith("/") else url + "/"


class _Store:
    """The kvstore and the zarr3 arrays under one URL."""

    def __init__(self, url: str, context: ts.Context | None, zstd_level: int) -> None:
        self.url = _base_url(url)
        self.context = context if context is not None else ts.Context()
        self.zstd_level = zstd_level
        try:
            self.kv = ts.KvStore.open(self.url, context=self.context).result()
        except Exception as e:  # tensorstore raises ValueError for bad specs
            raise WeightSyncError(f"cannot open weight-sync url {url!r}: {e}") from e

    def read_json(self, key: str) -> dict | None:
        try:
            r = self.kv.read(key).result()
        except Exception as e:  # a store error (network, permissions): the caller may retry
            raise WeightSyncError(f"{self.url}{key} cannot be read: {e}") from e
        if r.state == "missing":
            return None
        try:
            out = json.loads(r.value)
        except ValueError as e:
            raise WeightSyncError(f"{self.url}{key} is not valid JSON: {e}") from e
        if not isinstance(out, dict):
            raise WeightSyncError(f"{self.url}{key} holds a {type(out).__name__}, expected an object")
        return out

    def write_json(self, key: str, obj: dict) -> None:
        self.kv.write(key, json.dumps(obj, indent=1).encode()).result()

    def versions(self) -> list[int]:
        keys = self.kv.list(ts.KvStore.KeyRange("versions/", "versions0")).result()
        return sorted(int(m.group(1)) for k in keys if (m := _VERSION_RE.match(k.decode())))

    def latest(self) -> int | None:
        obj = self.read_json("latest")
        if obj is None:
            return None
        v = obj.get("version")
        if not isinstance(v, int):
            raise WeightSyncError(f"{self.url}latest holds {obj!r}, expected {{'version': <int>}}")
        return v

    def _spec(self, key: str) -> dict:
        return {"driver": "zarr3", "kvstore": self.url + key}

    def array_spec(self, key: str, bits_dtype: np.dtype, shape: list[int], chunk: list[int]) -> dict:
        """The zarr3 spec (zstd) of a uint bits array of `shape` in chunks of `chunk`."""
        metadata: dict[str, Any] = {
            "data_type": np.dtype(bits_dtype).name,
            "shape": shape,
            "codecs": [
                {"name": "bytes", "configuration": {"endian": "little"}},
                {"name": "zstd", "configuration": {"level": self.zstd_level}},
            ],
        }
        if shape:
            metadata["chunk_grid"] = {"name": "regular", "configuration": {"chunk_shape": chunk}}
        return {**self._spec(key), "metadata": metadata}

    def write_array(self, key: str, bits: np.ndarray) -> int:
        shape = list(bits.shape)
        chunk = list(shape) if shape else []
        if shape and bits.nbytes > _CHUNK_BYTES:
            row = max(1, bits.nbytes // max(shape[0], 1))
            chunk[0] = max(1, _CHUNK_BYTES // row)
        spec = self.array_spec(key, bits.dtype, shape, chunk)
        arr = ts.open(spec, create=True, delete_existing=True, context=self.context).result()
        arr.write(bits).result()
        return self.stored_bytes(key)

    def read_array(self, key: str) -> np.ndarray:
        arr = ts.open(self._spec(key), open=True, context=self.context).result()
        return np.asarray(arr.read().result(), order="C")

    def stored_bytes(self, prefix: str) -> int:
        keys = self.kv.list(ts.KvStore.KeyRange(prefix, prefix[:-1] + chr(ord(prefix[-1]) + 1))).result()
        return sum(len(self.kv.read(k).result().value) for k in keys)


def check_new_base_fraction(new_base_fraction: float) -> None:
    """Reject a `new_base_fraction` that is not a number > 0 (shared by both publishers)."""
    if (
        isinstance(new_base_fraction, bool)
        or not isinstance(new_base_fraction, (int, float))
        or not new_base_fraction > 0
    ):
        raise WeightSyncError(f"new_base_fraction={new_base_fraction!r}; accepted: a number > 0")


def next_version(version: int | None, latest: int | None) -> int:
    """The version a publish writes: `version`, checked to be an int above `latest` (>= 0), or by
    default latest + 1 (0 for an empty store). Shared by both publishers."""
    if version is None:
        return 0 if latest is None else latest + 1
    if (
        isinstance(version, bool)
        or not isinstance(version, int)
        or version < 0
        or (latest is not None and version <= latest)
    ):
        raise WeightSyncError(f"version={version!r}; accepted: an int > latest version {latest} (>= 0)")
    return version


def _check_level(zstd_level: int) -> None:
    if not isinstance(zstd_level, int) or not -7 <= zstd_level <= 22:
        raise WeightSyncError(f"zstd_level={zstd_level!r}; accepted: an int in [-7, 22]")


class WeightPublisher:
    """Writes policy versions to a kvstore URL as base snapshots plus zstd-compressed XOR deltas
    (a `Publisher`: one process writes; its `params` are numpy arrays or jax.Arrays this process
    holds whole, copied to the host here).

    `new_base_fraction`: a new base is written when the stored bytes of the deltas since the latest
    base reach this fraction of the base's stored bytes (> 0; 0 is not accepted, use
    `publish(..., force_base=True)`). `delta_against`: "previous" (each delta XORs the version before
    it) or "base" (each delta XORs the latest base; module docstring). Reopening a URL that holds
    versions continues after the latest. `context`: a tensorstore Context shared with subscribers in
    the same process (needed for ``memory://``, whose store lives in the context).
    """

    def __init__(
        self,
        url: str,
        *,
        new_base_fraction: float = 0.5,
        delta_against: str = "previous",
        zstd_level: int = 3,
        context: ts.Context | None = None,
    ) -> None:
        check_new_base_fraction(new_base_fraction)
        if delta_against not in ("previous", "base"):
            raise WeightSyncError(f"delta_against={delta_against!r}; accepted: 'previous' or 'base'")
        _check_level(zstd_level)
        self.new_base_fraction = float(new_base_fraction)
        self.delta_against = delta_against
        self.store = _Store(url, context, zstd_level)
        self._ref: dict[str, np.ndarray] | None = None  # bits of the version the next delta XORs
        self._ref_version: int | None = None
        self._base_manifest: dict | None = None
        self._since_base = 0
        self._load()

    def _load(self) -> None:
        """The state the next publish continues from: the store's latest version and its base."""
        self._ref, self._ref_version, self._base_manifest, self._since_base = None, None, None, 0
        self.latest = self.store.latest()
        if self.latest is not None:
            base_v = int(_read_manifest(self.store, self.latest)["base_version"])
            self._base_manifest = _read_manifest(self.store, base_v)
            self._ref_version = self.latest if self.delta_against == "previous" else base_v
            self._ref = _Reader(self.store).bits(self._ref_version)
            self._since_base = sum(
                _read_manifest(self.store, v)["stored_bytes"]
                for v in self.store.versions()
                if base_v < v <= self.latest
            )

    def rewind(self, version: int) -> list[int]:
        """Forget the versions after `version`, a lineage lost with a trainer that restarts from
        `version`'s checkpoint: `latest` points at `version` again, the later versions' files are
        deleted, and the next publish writes version + 1 anew. Returns the versions removed.
        (A subscriber that read a removed version keeps it in its cache: restart it, or make it
        forget, before it reads the new version of that number.)"""
        gone = rewind_store(self.store, version)
        if not gone and self.latest == version:
            return []
        self._load()
        return gone

    def publish(
        self, params: Any, version: int | None = None, *, dtype: str = "", force_base: bool = False
    ) -> PublishInfo:
        """Write `params` as `version` (default: latest + 1, or 0), floating leaves cast to `dtype`
        first ("" = as is), and point `latest` at it."""
        cast = publish_dtype(dtype)
        version = next_version(version, self.latest)
        leaves = _flatten(params, cast)
        if not leaves:
            raise WeightSyncError("params has no array leaves; nothing to publish")
        ref, base_bm = self._ref, self._base_manifest
        layout_same = (
            ref is not None
            and base_bm is not None
            and [(p, a.dtype.name, list(a.shape)) for p, a in leaves]
            == [(lf["path"], lf["dtype"], lf["shape"]) for lf in base_bm["leaves"]]
        )
        as_delta = (
            not force_base
            and layout_same
            and base_bm is not None
            and self._since_base < self.new_base_fraction * max(int(base_bm["stored_bytes"]), 1)
        )
        vdir = _vdir(version)
        entries: list[dict[str, Any]] = []
        bits_by_path: dict[str, np.ndarray] = {}
        for i, (path, arr) in enumerate(leaves):
            bits = _bits(arr)
            bits_by_path[path] = bits
            stored = bits ^ ref[path] if as_delta and ref is not None else bits
            nbytes = self.store.write_array(f"{vdir}leaves/{i}/", stored)
            entries.append(
                {
                    "path": path,
                    "dtype": arr.dtype.name,
                    "shape": list(arr.shape),
                    "key": f"leaves/{i}/",
                    "sha256": _sha256(arr),
                    "raw_bytes": arr.nbytes,
                    "stored_bytes": nbytes,
                }
            )
        beside: dict[str, Any] | None = None
        if not as_delta and layout_same and self.delta_against == "previous" and ref is not None:
            # a follower that holds the previous version reads this delta instead of the new base
            keys, nbytes_total = [], 0
            for i, (path, _) in enumerate(leaves):
                keys.append(f"delta/{i}/")
                nbytes_total += self.store.write_array(f"{vdir}delta/{i}/", bits_by_path[path] ^ ref[path])
            beside = {"parent_version": self._ref_version, "keys": keys, "stored_bytes": nbytes_total}
        kind = "delta" if as_delta else "base"
        base_version = int(base_bm["version"]) if as_delta and base_bm is not None else version
        parent_version = self._ref_version if as_delta and self._ref_version is not None else version
        raw_total = sum(int(e["raw_bytes"]) for e in entries)
        stored_total = sum(int(e["stored_bytes"]) for e in entries)
        manifest: dict[str, Any] = {
            "format": 1,
            "version": version,
            "kind": kind,
            "base_version": base_version,
            "parent_version": parent_version,
            "raw_bytes": raw_total,
            "stored_bytes": stored_total,
            "leaves": entries,
        }
        if beside is not None:
            manifest["delta"] = beside
        self.store.write_json(vdir + "manifest.json", manifest)
        self.store.write_json("latest", {"version": version})
        self.latest = version
        if as_delta:
            self._since_base += stored_total
        else:
            self._base_manifest, self._since_base = manifest, 0
        if not as_delta or self.delta_against == "previous":
            self._ref, self._ref_version = {p: b.copy() for p, b in bits_by_path.items()}, version
        follower = beside["stored_bytes"] if beside is not None else stored_total
        return PublishInfo(version, kind, base_version, raw_total, stored_total, follower, manifest)


def rewind_store(store: _Store, version: int) -> list[int]:
    """Point `latest` at `version` and delete the versions after it (`WeightPublisher.rewind`);
    returns the versions removed. For a store whose writers are not one `WeightPublisher` (a
    multi-host trainer's per-shard writers): one process calls it before they reopen the store."""
    have = store.versions()
    if isinstance(version, bool) or not isinstance(version, int) or version not in have:
        raise WeightSyncError(f"rewind to version={version!r}; accepted: a version in the store {have}")
    gone = [v for v in have if v > version]
    if not gone and store.latest() == version:
        return []
    store.write_json("latest", {"version": version})  # readers stop following the lost versions first
    for v in gone:
        vdir = _vdir(v)
        store.kv.delete_range(ts.KvStore.KeyRange(vdir, vdir[:-1] + chr(ord(vdir[-1]) + 1))).result()
    return gone


def open_store(url: str, context: ts.Context | None = None, zstd_level: int = 3) -> _Store:
    """The kvstore under `url` (for writers other than `WeightPublisher`: sharded_publish.py)."""
    _check_level(zstd_level)
    return _Store(url, context, zstd_level)


def version_dir(version: int) -> str:
    """`versions/<8 digits>/`, the key prefix of one version."""
    return _vdir(version)


def read_manifest(store: _Store, version: int) -> dict:
    """The checked manifest of `version` (WeightSyncError naming what is wrong)."""
    return _read_manifest(store, version)


def _read_manifest(store: _Store, version: int) -> dict:
    m = store.read_json(_vdir(version) + "manifest.json")
    if m is None:
        have = store.versions()
        raise WeightSyncError(
            f"version {version} is not in {store.url}; it holds versions {have or 'none (empty store)'}"
        )
    for field in ("version", "kind", "base_version", "leaves", "stored_bytes"):
        if field not in m:
            raise WeightSyncError(f"manifest of version {version} in {store.url} lacks {field!r}")
    if m.get("format", 1) not in _FORMATS:
        raise WeightSyncError(
            f"manifest of version {version} in {store.url} has format {m.get('format')!r}; this reader "
            f"knows formats {_FORMATS}: read it with a newer composer_jax"
        )
    if m["version"] != version or m["kind"] not in ("base", "delta", "sharded", "sharded_delta"):
        raise WeightSyncError(
            f"manifest of version {version} in {store.url} says version={m['version']!r} kind={m['kind']!r}"
        )
    return m


def _read_leaves(store: _Store, manifest: dict, base_bits: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Reconstruct and checksum every leaf of `manifest` (XOR with `base_bits` for a delta)."""
    version, out = manifest["version"], {}
    vdir = _vdir(version)
    for lf in manifest["leaves"]:
        try:
            path, dtype, shape, key, want = (
                lf["path"],
                _dtype_from_name(lf["dtype"]),
                tuple(lf["shape"]),
                lf["key"],
                lf["shards"] if manifest["kind"].startswith("sharded") else lf["sha256"],
            )
        except (KeyError, TypeError) as e:
            raise WeightSyncError(
                f"manifest of version {version} in {store.url} has a malformed leaf entry {lf!r}"
            ) from e
        try:
            stored = store.read_array(vdir + key)
        except Exception as e:
            raise WeightSyncError(f"leaf {path!r} of version {version} in {store.url} cannot be read: {e}") from e
        if stored.shape != shape or stored.dtype != _UINT[dtype.itemsize]:
            raise WeightSyncError(
                f"leaf {path!r} of version {version}: stored {stored.dtype}{list(stored.shape)}, "
                f"manifest says {dtype}{list(shape)}"
            )
        if manifest["kind"] in ("delta", "sharded_delta"):
            if path not in base_bits:
                raise WeightSyncError(
                    f"leaf {path!r} of version {version} has no counterpart in its parent version {_parent(manifest)}"
                )
            stored = np.asarray(stored ^ base_bits[path])  # 0-d: an array, not a numpy scalar
        if manifest["kind"] in ("sharded", "sharded_delta"):
            _check_shards(stored, lf, version, store.url)
        arr = stored.view(dtype)
        if manifest["kind"] not in ("sharded", "sharded_delta") and _sha256(arr) != want:
            raise WeightSyncError(
                f"checksum mismatch for leaf {path!r} of version {version} ({manifest['kind']}) in {store.url}"
            )
        out[path] = arr
    return out


def _check_shards(bits: np.ndarray, lf: dict, version: int, url: str) -> None:
    """Every shard of a sharded leaf against its sha256; the shards must tile the leaf."""
    total = 0
    for sh in lf["shards"]:
        region = bits[tuple(slice(a, b) for a, b in sh["index"])]
        total += region.size
        if _sha256(region) != sh["sha256"]:
            raise WeightSyncError(
                f"checksum mismatch for shard {sh['index']} of leaf {lf['path']!r} of version {version} in {url}"
            )
    if total != bits.size:
        raise WeightSyncError(
            f"the shards of leaf {lf['path']!r} of version {version} in {url} cover {total} of {bits.size} elements"
        )


def _parent(m: dict) -> int:
    """The version a delta XORs (format 1 manifests written before chains: the base)."""
    parent = m.get("parent_version", m["base_version"])
    if not isinstance(parent, int) or not 0 <= parent < m["version"]:
        raise WeightSyncError(f"manifest of version {m['version']} names parent version {parent!r}")
    return parent


def _beside_as_delta(m: dict, beside: dict) -> dict:
    """A base's manifest read through the delta written beside it (same checksums)."""
    keys = beside.get("keys")
    if not isinstance(keys, list) or len(keys) != len(m["leaves"]):
        raise WeightSyncError(f"manifest of version {m['version']} has a malformed 'delta' entry")
    leaves = [{**lf, "key": k} for lf, k in zip(m["leaves"], keys, strict=True)]
    return {
        **m,
        "kind": "delta",
        "is_base": True,
        "parent_version": beside["parent_version"],
        "stored_bytes": beside.get("stored_bytes", 0),
        "leaves": leaves,
    }


class _Reader:
    """Reconstructs versions by following parents back to a base or a cached version. Caches the
    bits of the latest base and of the last version read, so a subscriber following every version
    reads one delta per version in either mode."""

    def __init__(self, store: _Store) -> None:
        self.store = store
        self._cache: dict[int, dict[str, np.ndarray]] = {}
        self._base: int | None = None
        self.bytes_read = 0  # stored bytes of the leaves read so far

    def forget(self) -> None:
        self._cache, self._base = {}, None

    def views(self, version: int) -> dict[str, np.ndarray]:
        """version -> {leaf path: array in its dtype}, every leaf checksummed."""
        chain: list[dict] = []
        v: int | None = version
        while v is not None and v not in self._cache:
            m = _read_manifest(self.store, v)
            beside = m.get("delta") if m["kind"] == "base" else None
            if isinstance(beside, dict) and beside.get("parent_version") in self._cache:
                m = _beside_as_delta(m, beside)  # a base with a delta beside it, whose parent we hold
            chain.append(m)
            v = None if m["kind"] in ("base", "sharded") else _parent(m)
        bits = self._cache[v] if v is not None else {}
        out: dict[str, np.ndarray] = {}
        for m in reversed(chain):
            out = _read_leaves(self.store, m, bits)
            bits = {p: _bits(a) for p, a in out.items()}
            self.bytes_read += int(m["stored_bytes"])
            if m["kind"] in ("base", "sharded") or m.get("is_base"):
                self._base = int(m["version"])
                self._cache = {self._base: bits}
        if not chain:  # the cached version itself
            out = {p: b.view(_dtype_from_name(lf["dtype"])) for p, b, lf in self._leaf_meta(version, bits)}
        keep = {k: self._cache[k] for k in (self._base,) if k is not None and k in self._cache}
        self._cache = {**keep, version: bits}
        return out

    def _leaf_meta(self, version: int, bits: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray, dict]]:
        m = _read_manifest(self.store, version)
        return [(lf["path"], bits[lf["path"]], lf) for lf in m["leaves"]]

    def bits(self, version: int) -> dict[str, np.ndarray]:
        return {p: _bits(a).copy() for p, a in self.views(version).items()}


class WeightSubscriber:
    """Reads versions written by a `WeightPublisher` at `url` and reconstructs them bit-exactly.

    The latest base's bits are cached, so following a run of deltas reads each delta only.

    Fallback (`read(..., fallback=True)`, the default): when a version fails to read (a leaf or the
    manifest missing or unreadable, a sha256 mismatch in the version or in its base), the subscriber
    drops its cached base, waits `retry_delay_s` and reads base and version again (the writer may have
    been mid-write, or the store failed transiently); if that fails too it reads the newest version
    before it that does read, and `last_fallback` says what happened. When none reads, the
    WeightSyncError of the first failure (naming its version and leaf) is raised.
    """

    def __init__(self, url: str, *, context: ts.Context | None = None, retry_delay_s: float = 0.2) -> None:
        if isinstance(retry_delay_s, bool) or not isinstance(retry_delay_s, (int, float)) or retry_delay_s < 0:
            raise WeightSyncError(f"retry_delay_s={retry_delay_s!r}; accepted: a number >= 0")
        self.store = _Store(url, context, 3)
        self.retry_delay_s = float(retry_delay_s)
        self._reader = _Reader(self.store)
        self.last_fallback: str | None = None  # why the latest read returned another version, or None

    @property
    def bytes_read(self) -> int:
        """Stored bytes of the leaves this subscriber has read (bases and deltas)."""
        return self._reader.bytes_read

    def latest_version(self) -> int | None:
        """The version `latest` points at, or None for an empty store."""
        return self.store.latest()

    def versions(self) -> list[int]:
        """Every version with a manifest, ascending."""
        return self.store.versions()

    def manifest(self, version: int) -> dict:
        """The manifest of `version` (WeightSyncError naming the versions present if absent)."""
        return _read_manifest(self.store, version)

    def read(self, version: int | None = None, *, fallback: bool = True) -> tuple[int, dict]:
        """(version read, params) for `version` (default: latest); leaves are numpy arrays.

        With `fallback` the version read may be older than the one asked for (class docstring);
        without it the first failure raises."""
        if version is None:
            version = self.store.latest()
            if version is None:
                raise WeightSyncError(
                    f"weight-sync store {self.store.url} is empty: no 'latest' pointer; "
                    f"versions present: {self.store.versions() or 'none'}"
                )
        self.last_fallback = None
        try:
            return version, self._read_once(version)
        except WeightSyncError as first:
            latest = self.store.latest()
            if not fallback or latest is None or version > latest:  # never published: nothing to fall back for
                raise
            failure = first
        self._reader.forget()
        time.sleep(self.retry_delay_s)
        try:
            params = self._read_once(version)
        except WeightSyncError:
            pass
        else:
            self.last_fallback = f"version {version} read on the second try after: {failure}"
            return version, params
        for older in sorted((v for v in self.store.versions() if v < version), reverse=True):
            try:
                params = self._read_once(older)
            except WeightSyncError:
                self._reader.forget()
                continue
            self.last_fallback = f"version {version} failed twice ({failure}); read version {older} instead"
            return older, params
        raise WeightSyncError(f"version {version} failed twice and no earlier version reads: {failure}") from failure

    def _read_once(self, version: int) -> dict:
        return _unflatten(self._reader.views(version))


def tree_sha256(params: Any) -> str:
    """One sha256 over every leaf's path, dtype, shape and raw bytes (to compare across processes)."""
    h = hashlib.sha256()
    for path, arr in _flatten(params):
        h.update(f"{path}|{arr.dtype.name}|{list(arr.shape)}|".encode())
        h.update(arr.tobytes())
    return h.hexdigest()
