"""The weight-sync store's format, shared by its writers (publisher.py, sharded.py) and its reader
(subscriber.py): the on-disk layout under a tensorstore kvstore URL, the manifest and its formats,
version naming, the tree <-> leaf-path mapping, the bit and checksum rules, the kvstore access, and
the one error type, `WeightSyncError`. Also the publishing contract both writers implement
(`Publisher`, `PublishInfo`, the version and dtype rules), so neither writer imports the other.

A store at a URL (``file://DIR`` by default, or any tensorstore kvstore URL: ``gs://``, ``s3://``,
``memory://``) holds policy versions of a parameter pytree (nested dicts of arrays; a leaf's path is
its keys joined with '/'). A version is either a *base* (the raw bit patterns of every leaf) or a
*delta* against a parent version (the bit patterns viewed as same-width unsigned ints XOR-ed with the
parent's), each leaf a zarr3 array with the zstd codec, so a small update (most bits equal)
compresses well. Layout under the URL::

    versions/00000007/manifest.json       version, kind, base_version, parent_version, leaves (path,
                                          dtype, shape, sha256 of the reconstructed bytes, stored_bytes)
    versions/00000007/leaves/<i>/...      one zarr3 array per leaf (uint bits or XOR bits)
    versions/00000007/delta/<i>/...       a base's delta against the version before, when written
    latest                                {"version": 7}, written last

Manifest format 1: one writer, whole leaves (kind "base" / "delta"); format 2 adds kind "sharded"
(every process of a multi-host trainer writes its own shards) and "sharded_delta" (XOR-ed shard by
shard with its parent): per-shard index ranges and sha256s. A manifest of a format this module does
not know is refused by name. The manifest is written after every leaf and ``latest`` after the
manifest, so a reader that follows ``latest`` never sees a half-written version.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
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


def dtype_from_name(name: str) -> np.dtype:
    """The numpy dtype a manifest names (numpy's names, then ml_dtypes': bfloat16, float8_*)."""
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


def host_leaves(tree: Any, cast: np.dtype | None = None) -> list[tuple[str, np.ndarray]]:
    """The leaves of a tree of arrays this process holds whole, as C-ordered host arrays, floating
    ones cast to `cast` (None: as is); itemsizes 1, 2, 4, 8."""
    return flatten_tree(tree, lambda path, node: _host_leaf(path, node, cast), "dict or array")


def unflatten(leaves: dict[str, np.ndarray]) -> dict:
    """The tree of nested dicts whose leaves are {"a/b/c": leaf} (`flatten_tree` undone)."""
    root: dict = {}
    for path, arr in leaves.items():
        node = root
        *parents, last = path.split("/")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = arr
    return root


def bits_dtype(dtype: np.dtype) -> np.dtype:
    """The unsigned int dtype of `dtype`'s width, which the store holds a leaf's bits in."""
    return _UINT[np.dtype(dtype).itemsize]


def as_bits(arr: np.ndarray) -> np.ndarray:
    """`arr`'s bit patterns (a view as the same-width unsigned ints), which a delta XORs."""
    return arr.view(bits_dtype(arr.dtype))


def array_sha256(arr: np.ndarray) -> str:
    """The sha256 of `arr`'s bytes in C order (a manifest's checksum of a leaf or a shard)."""
    return hashlib.sha256(np.asarray(arr, order="C").tobytes()).hexdigest()


def version_dir(version: int) -> str:
    """`versions/<8 digits>/`, the key prefix of one version."""
    return f"versions/{version:08d}/"


def _base_url(url: str) -> str:
    if not isinstance(url, str) or "://" not in url:
        raise WeightSyncError(
            f"weight-sync url {url!r} is not a kvstore URL; accepted: file://DIR, memory://, "
            "gs://BUCKET/PATH, s3://BUCKET/PATH or any tensorstore kvstore URL"
        )
    return url if url.endswith("/") else url + "/"


class Store:
    """The kvstore and the zarr3 arrays under one URL (`open_store`)."""

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


def _check_level(zstd_level: int) -> None:
    if not isinstance(zstd_level, int) or not -7 <= zstd_level <= 22:
        raise WeightSyncError(f"zstd_level={zstd_level!r}; accepted: an int in [-7, 22]")


def open_store(url: str, context: ts.Context | None = None, zstd_level: int = 3) -> Store:
    """The kvstore and zarr3 arrays under `url`, written with zstd at `zstd_level` (checked)."""
    _check_level(zstd_level)
    return Store(url, context, zstd_level)


def read_manifest(store: Store, version: int) -> dict:
    """The checked manifest of `version` (WeightSyncError naming what is wrong)."""
    m = store.read_json(version_dir(version) + "manifest.json")
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


def tree_sha256(params: Any) -> str:
    """One sha256 over every leaf's path, dtype, shape and raw bytes (to compare across processes)."""
    h = hashlib.sha256()
    for path, arr in host_leaves(params):
        h.update(f"{path}|{arr.dtype.name}|{list(arr.shape)}|".encode())
        h.update(arr.tobytes())
    return h.hexdigest()


# The publishing contract both writers implement (publisher.py's WeightPublisher, sharded.py's
# ShardedWeightPublisher), here so that neither imports the other.


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
        out = dtype_from_name(dtype) if isinstance(dtype, str) else None
        if out is not None:
            ml_dtypes.finfo(out)  # a floating type (numpy's or ml_dtypes')
    except (WeightSyncError, TypeError, ValueError):
        out = None
    if out is None:
        raise WeightSyncError(
            f"dtype={dtype!r}; accepted: '' (as is) or a floating dtype name such as 'bfloat16', 'float32'"
        )
    return out


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
