"""The reading side of weight sync: `WeightSubscriber` (the latest or a given version, reconstructed
bit-exactly from its base and deltas), `read_shard` (the index ranges of one leaf of a per-shard
version) and `StoreWeights` (versions in the served parameter tree). The store's layout and manifest
are store.py's; publisher.py and sharded.py write it.

A `WeightSubscriber` (in any process or host) reads the latest or a given version and reconstructs
the pytree bit-exactly, checking every leaf's sha256 (`WeightSyncError` names the leaf and version);
a version that fails its checks is read again (base included), then the newest earlier version that
reads is returned instead (`WeightSubscriber` docstring). A per-shard version (sharded.py) is read
the same way, every shard checksummed.

`StoreWeights` keeps one `WeightSubscriber` per store URL (so a replica that follows a run of
deltas reads each delta once, not its base again) and turns a stored version into the served tree:
same paths and shapes as the served parameters, cast to their dtypes and put on their shardings
(the store holds plain arrays; the trainer may publish float32 or bfloat16). The version numbers a
replica serves are the published ones. Used by `/admin/load_weights` with `"source": "weight_store"`
and by `composer-jax serve --weights-from URL`, which polls the store (`inference/server/app.py`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import threading
import time
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from composer_jax.weightsync.store import (
    Store,
    WeightSyncError,
    array_sha256,
    as_bits,
    bits_dtype,
    dtype_from_name,
    open_store,
    read_manifest,
    unflatten,
    version_dir,
)


def _read_leaves(store: Store, manifest: dict, base_bits: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Reconstruct and checksum every leaf of `manifest` (XOR with `base_bits` for a delta)."""
    version, out = manifest["version"], {}
    vdir = version_dir(version)
    for lf in manifest["leaves"]:
        try:
            path, dtype, shape, key, want = (
                lf["path"],
                dtype_from_name(lf["dtype"]),
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
        if stored.shape != shape or stored.dtype != bits_dtype(dtype):
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
        if manifest["kind"] not in ("sharded", "sharded_delta") and array_sha256(arr) != want:
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
        if array_sha256(region) != sh["sha256"]:
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


class VersionReader:
    """Reconstructs versions by following parents back to a base or a cached version. Caches the
    bits of the latest base and of the last version read, so a subscriber following every version
    reads one delta per version in either mode."""

    def __init__(self, store: Store) -> None:
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
            m = read_manifest(self.store, v)
            beside = m.get("delta") if m["kind"] == "base" else None
            if isinstance(beside, dict) and beside.get("parent_version") in self._cache:
                m = _beside_as_delta(m, beside)  # a base with a delta beside it, whose parent we hold
            chain.append(m)
            v = None if m["kind"] in ("base", "sharded") else _parent(m)
        bits = self._cache[v] if v is not None else {}
        out: dict[str, np.ndarray] = {}
        for m in reversed(chain):
            out = _read_leaves(self.store, m, bits)
            bits = {p: as_bits(a) for p, a in out.items()}
            self.bytes_read += int(m["stored_bytes"])
            if m["kind"] in ("base", "sharded") or m.get("is_base"):
                self._base = int(m["version"])
                self._cache = {self._base: bits}
        if not chain:  # the cached version itself
            out = {p: b.view(dtype_from_name(lf["dtype"])) for p, b, lf in self._leaf_meta(version, bits)}
        keep = {k: self._cache[k] for k in (self._base,) if k is not None and k in self._cache}
        self._cache = {**keep, version: bits}
        return out

    def _leaf_meta(self, version: int, bits: dict[str, np.ndarray]) -> list[tuple[str, np.ndarray, dict]]:
        m = read_manifest(self.store, version)
        return [(lf["path"], bits[lf["path"]], lf) for lf in m["leaves"]]

    def bits(self, version: int) -> dict[str, np.ndarray]:
        return {p: as_bits(a).copy() for p, a in self.views(version).items()}


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
        self.store = open_store(url, context)
        self.retry_delay_s = float(retry_delay_s)
        self._reader = VersionReader(self.store)
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
        return read_manifest(self.store, version)

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
        return unflatten(self._reader.views(version))


def read_shard(
    url: str, version: int, path: str, index: tuple[slice, ...], *, context: ts.Context | None = None
) -> np.ndarray:
    """Only the index ranges `index` of leaf `path` in a per-shard `version` (a serving shard
    loading its slice): the stored shards the request overlaps are read, XOR-ed back through the
    deltas to the snapshot, and each checked against its sha256."""
    store = open_store(url, context)
    chain = [read_manifest(store, version)]
    while chain[-1]["kind"] == "sharded_delta":
        chain.append(read_manifest(store, int(chain[-1]["parent_version"])))
    if chain[-1]["kind"] != "sharded":
        raise WeightSyncError(
            f"version {version} in {store.url} is a {chain[-1]['kind']!r} version (or a delta against one); "
            "read_shard reads versions written per shard ('sharded', 'sharded_delta')"
        )
    leaves = []
    for m in chain:
        lf = next((x for x in m["leaves"] if x["path"] == path), None)
        if lf is None:
            have = [x["path"] for x in m["leaves"]][:8]
            raise WeightSyncError(f"version {m['version']} has no leaf {path!r}; leaves: {have}")
        leaves.append((m["version"], lf))
    lf = leaves[0][1]
    shape = tuple(lf["shape"])
    if len(index) > len(shape):
        raise WeightSyncError(f"index {index!r} for leaf {path!r} of shape {list(shape)}: too many dimensions")
    want = [range(*sl.indices(n)) for sl, n in zip(index, shape)] + [range(n) for n in shape[len(index) :]]
    if any(r.step != 1 for r in want):
        raise WeightSyncError(f"index {index!r} for leaf {path!r}; accepted: unit-step slices")
    dt = np.dtype(jax.numpy.dtype(lf["dtype"]))
    arrays = [
        ts.open(
            {"driver": "zarr3", "kvstore": store.url + version_dir(v) + x["key"]}, open=True, context=store.context
        ).result()
        for v, x in leaves
    ]
    out = np.zeros([len(r) for r in want], bits_dtype(dt))
    covered = 0
    for sh in lf["shards"]:
        rng = [range(a, b) for a, b in sh["index"]]
        lo = [max(r.start, w.start) for r, w in zip(rng, want)]
        hi = [min(r.stop, w.stop) for r, w in zip(rng, want)]
        if any(a >= b for a, b in zip(lo, hi)):
            continue
        region = tuple(slice(r.start, r.stop) for r in rng)
        bits = np.zeros([len(r) for r in rng], bits_dtype(dt))
        for arr in arrays:  # the snapshot and every delta since, XOR-ed
            bits ^= np.asarray(arr[region].read().result() if region else arr.read().result())
        if hashlib.sha256(bits.tobytes()).hexdigest() != sh["sha256"]:
            raise WeightSyncError(f"checksum mismatch for shard {sh['index']} of leaf {path!r}, version {version}")
        src = tuple(slice(a - r.start, b - r.start) for a, b, r in zip(lo, hi, rng))
        dst = tuple(slice(a - w.start, b - w.start) for a, b, w in zip(lo, hi, want))
        out[dst] = bits[src]
        covered += int(np.prod([b - a for a, b in zip(lo, hi)]))
    if covered != out.size:
        raise WeightSyncError(f"the shards of leaf {path!r} in version {version} do not cover {index!r}")
    return out.view(dt)


@dataclasses.dataclass(frozen=True)
class StoreVersion:
    """A version read from a store: `version` may be older than the one asked for when the store
    held a bad copy (`fallback` says why; None when the asked-for version read)."""

    url: str
    version: int
    params: Any
    fallback: str | None


def _paths(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k in sorted(tree):
            out.update(_paths(tree[k], f"{prefix}/{k}" if prefix else str(k)))
        return out
    return {prefix: tree}


class StoreWeights:
    """Reads versions from weight-sync stores by URL into the served tree (module docstring)."""

    def __init__(self, retry_delay_s: float = 0.2) -> None:
        self._subs: dict[str, WeightSubscriber] = {}
        self._lock = threading.Lock()
        self.retry_delay_s = retry_delay_s

    def subscriber(self, url: str) -> WeightSubscriber:
        """The subscriber of `url` (opened once; WeightSyncError for a URL tensorstore cannot open)."""
        with self._lock:
            if url not in self._subs:
                self._subs[url] = WeightSubscriber(url, retry_delay_s=self.retry_delay_s)
            return self._subs[url]

    def latest(self, url: str) -> int | None:
        return self.subscriber(url).latest_version()

    def read(self, url: str, version: int | None, served: Any) -> StoreVersion:
        """`version` (None: the latest) of the store at `url`, as arrays shaped, typed and sharded
        like `served`; WeightSyncError when the store lacks it or its tree differs from `served`."""
        sub = self.subscriber(url)
        got, tree = sub.read(version)
        return StoreVersion(url, got, to_served(tree, served, f"version {got} of {url}"), sub.last_fallback)


def to_served(tree: Any, served: Any, what: str) -> Any:
    """`tree` (nested dicts of numpy arrays) in the structure, dtypes and shardings of `served`."""
    new, old = _paths(tree), _paths(served)
    if new.keys() != old.keys():
        missing, extra = sorted(old.keys() - new.keys()), sorted(new.keys() - old.keys())
        raise WeightSyncError(
            f"{what} is not the served model's parameter tree: missing {missing[:5]}, unexpected {extra[:5]}"
        )
    for path, a in new.items():
        if tuple(np.shape(a)) != tuple(old[path].shape):
            raise WeightSyncError(
                f"{what}: leaf {path!r} has shape {list(np.shape(a))}, the served model's is {list(old[path].shape)}"
            )
    leaves = {p: jax.device_put(np.asarray(a).astype(old[p].dtype), old[p].sharding) for p, a in new.items()}

    def rebuild(node: Any, prefix: str) -> Any:
        if isinstance(node, dict):
            return {k: rebuild(v, f"{prefix}/{k}" if prefix else str(k)) for k, v in node.items()}
        return leaves[prefix]

    return rebuild(served, "")
