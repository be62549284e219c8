"""Per-shard weight publishing: every trainer process writes the shards it holds, no host gathers.

A `ShardedWeightPublisher` is constructed by every process of a multi-host trainer with the same
arguments, and `publish(params, version)` is called by every process with the same global
`jax.Array` tree (a collective). Each leaf becomes one zarr3 array of the full shape under
`versions/<v>/leaves/<i>/`, chunked by the leaf's shard shape, and each process writes only the
shards it holds with `replica_id == 0` (a replicated shard is written once, by the process holding
its first replica), so no chunk has two writers. A version is a snapshot (kind "sharded") or a
per-shard XOR delta against the version before (kind "sharded_delta"; class docstring). The
manifest (format 2) lists, per leaf, every shard's index ranges and the sha256 of its bytes; the
processes' shard entries are gathered as JSON (a few hundred bytes per shard), process 0 writes the
manifest and then `latest`. `publish_sharded(url, params, version)` writes one snapshot.

Like `WeightPublisher` (publisher.py) it is a `Publisher` (store.py: `publish(params, version, *,
dtype=...) -> PublishInfo`); publisher.py's `open_publisher(url)` gives the one a trainer of this
many processes writes with, so the trainer calls both the same way.

The store layout is the weight-sync store's (store.py): subscriber.py's `WeightSubscriber` reads a
sharded version into the full tree (every shard checksummed), a `WeightPublisher` may continue the
store with deltas against it, and subscriber.py's `read_shard` reads only the index ranges a reader
asks for (a serving shard loading its own slice).
"""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from composer_jax.multihost import allgather_json, barrier
from composer_jax.weightsync.store import (
    SHARDED_FORMAT,
    PublishInfo,
    WeightSyncError,
    bits_dtype,
    check_new_base_fraction,
    flatten_tree,
    next_version,
    open_store,
    publish_dtype,
    version_dir,
)


def _leaves(tree: Any) -> list[tuple[str, jax.Array]]:
    return flatten_tree(tree, lambda _path, node: node if isinstance(node, jax.Array) else None, "dict or jax.Array")


def _ranges(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[list[int]]:
    return [list(sl.indices(n)[:2]) for sl, n in zip(index, shape)]


class ShardedWeightPublisher:
    """Writes versions per shard from every process of a multi-host trainer (module docstring; a
    `Publisher`).

    Every process constructs one with the same arguments and calls `publish` for every version (a
    collective). A version is a snapshot (kind "sharded") or an XOR delta against the previous
    version (kind "sharded_delta": each process XORs its shards with its own shards of the version
    before, so no host ever holds more than its shards); a snapshot is written first, when the
    sharding changed, and once the deltas' stored bytes since the last snapshot reach
    `new_base_fraction` of its stored bytes. A publisher opened on a store that holds versions
    continues after the latest with a snapshot.
    """

    def __init__(
        self, url: str, *, new_base_fraction: float = 0.5, zstd_level: int = 3, context: ts.Context | None = None
    ) -> None:
        check_new_base_fraction(new_base_fraction)
        self.new_base_fraction = float(new_base_fraction)
        self.store = open_store(url, context, zstd_level)
        self.latest = self.store.latest()
        self._prev: dict[tuple[str, str], np.ndarray] | None = None  # this process's shards of `latest`
        self._base_version: int | None = None
        self._base_stored = 0
        self._since_base = 0

    def publish(
        self, params: Any, version: int | None = None, *, dtype: str = "", force_base: bool = False
    ) -> PublishInfo:
        """Write `params` (a dict tree of global jax.Arrays) as `version` (default: latest + 1, or
        0), floating leaves cast to `dtype` first ("" = as is). Returns what was written (its
        `manifest` too; `info["kind"]` reads the manifest's fields)."""
        leaves = _leaves(params)
        if not leaves:
            raise WeightSyncError("params has no array leaves; nothing to publish")
        version = next_version(version, self.latest)
        out_dtypes = _out_dtypes(leaves, publish_dtype(dtype))
        local, bits_now = _local_bits(leaves, out_dtypes)
        prev = self._prev
        same_layout = (
            prev is not None
            and set(prev) == set(bits_now)
            and all(prev[k].shape == b.shape and prev[k].dtype == b.dtype for k, b in bits_now.items())
        )
        # every process must take the same decision: a delta only if all can
        as_delta = (
            all(allgather_json(bool(same_layout)))
            and not force_base
            and self._since_base < self.new_base_fraction * max(self._base_stored, 1)
        )
        specs = self._create_arrays(leaves, out_dtypes, version)
        vdir = version_dir(version)
        entries = [
            self._write_leaf(f"{vdir}leaves/{i}/", path, arr, spec, mine, prev if as_delta else None)
            for i, ((path, arr), spec, mine) in enumerate(zip(leaves, specs, local))
        ]
        leaf_meta = _leaf_meta(leaves, out_dtypes, allgather_json(entries))
        stored_total = sum(int(lf["stored_bytes"]) for lf in leaf_meta)
        raw_total = sum(int(lf["raw_bytes"]) for lf in leaf_meta)
        kind = "sharded_delta" if as_delta else "sharded"
        base_version = self._base_version if as_delta and self._base_version is not None else version
        manifest = {
            "format": SHARDED_FORMAT,
            "version": version,
            "kind": kind,
            "base_version": base_version,
            "parent_version": self.latest if as_delta and self.latest is not None else version,
            "raw_bytes": raw_total,
            "stored_bytes": stored_total,
            "leaves": leaf_meta,
        }
        if jax.process_index() == 0:
            self.store.write_json(vdir + "manifest.json", manifest)
            self.store.write_json("latest", {"version": version})
        barrier(f"composer_jax_publish_sharded_done_{version}")
        # every process saw the same gathered sizes: the next decision agrees everywhere
        if as_delta:
            self._since_base += stored_total
        else:
            self._base_version, self._base_stored, self._since_base = version, stored_total, 0
        self._prev, self.latest = bits_now, version
        return PublishInfo(version, kind, base_version, raw_total, stored_total, stored_total, manifest)

    def _create_arrays(self, leaves: list[tuple[str, jax.Array]], out_dtypes: list[np.dtype], version: int) -> list:
        """One zarr3 array per leaf under the version (chunked by the leaf's shard shape), created by
        process 0 (the others open them after the barrier); their specs."""
        vdir = version_dir(version)
        specs = []
        for i, ((_, arr), dt) in enumerate(zip(leaves, out_dtypes)):
            chunk = list(arr.sharding.shard_shape(arr.shape))
            specs.append(self.store.array_spec(f"{vdir}leaves/{i}/", bits_dtype(dt), list(arr.shape), chunk))
        if jax.process_index() == 0:
            for spec in specs:
                ts.open(spec, create=True, delete_existing=True, context=self.store.context).result()
        barrier(f"composer_jax_publish_sharded_create_{version}")
        return specs

    def _write_leaf(
        self,
        key: str,
        path: str,
        arr: jax.Array,
        spec: dict,
        mine: list[tuple[tuple[slice, ...], np.ndarray]],
        prev: dict[tuple[str, str], np.ndarray] | None,
    ) -> list[dict]:
        """This process's shards of one leaf written (XOR-ed with `prev`'s when a delta); their
        manifest entries: index ranges, sha256 of the bits, the process, the bytes stored."""
        store, pi = self.store, jax.process_index()
        target = ts.open({k: v for k, v in spec.items() if k != "metadata"}, open=True, context=store.context).result()
        shard_shape = arr.sharding.shard_shape(arr.shape)
        writes, keys, leaf_entries = [], [], []
        for idx, bits in mine:
            ranges = _ranges(idx, arr.shape)
            stored = bits ^ prev[(path, str(ranges))] if prev is not None else bits
            writes.append(target[idx].write(stored) if idx else target.write(stored))
            # one shard = one chunk: its key under the zarr3 default encoding ("c/i/j", "c" for 0-d)
            keys.append(f"{key}c" + "".join(f"/{a // max(c, 1)}" for (a, _), c in zip(ranges, shard_shape)))
            leaf_entries.append({"index": ranges, "sha256": hashlib.sha256(bits.tobytes()).hexdigest(), "process": pi})
        for w in writes:
            w.result()
        for e, chunk_key in zip(leaf_entries, keys):  # a chunk equal to the fill value (0: an unchanged
            r = store.kv.read(chunk_key).result()  # shard's XOR) is not stored
            e["stored_bytes"] = len(r.value) if r.state != "missing" else 0
        return leaf_entries


def _out_dtypes(leaves: list[tuple[str, jax.Array]], cast: np.dtype | None) -> list[np.dtype]:
    """Each leaf's stored dtype: floating ones cast to `cast` (None: as is); itemsizes 1, 2, 4, 8."""
    out = []
    for _, arr in leaves:
        dt = np.dtype(arr.dtype)
        if cast is not None and np.issubdtype(dt, np.floating):
            dt = cast
        if dt.itemsize not in (1, 2, 4, 8):
            raise WeightSyncError(f"dtype {dt} of itemsize {dt.itemsize}; accepted itemsizes: 1, 2, 4, 8")
        out.append(dt)
    return out


def _local_bits(
    leaves: list[tuple[str, jax.Array]], out_dtypes: list[np.dtype]
) -> tuple[list[list[tuple[tuple[slice, ...], np.ndarray]]], dict[tuple[str, str], np.ndarray]]:
    """This process's replica-0 shards as bits: per leaf [(index, bits)], and {(path, ranges): bits}."""
    local: list[list[tuple[tuple[slice, ...], np.ndarray]]] = []
    bits_now: dict[tuple[str, str], np.ndarray] = {}
    for (path, arr), dt in zip(leaves, out_dtypes):
        mine = []
        for shard in arr.addressable_shards:
            if shard.replica_id != 0:
                continue
            host = np.asarray(shard.data)
            bits = np.asarray(host.astype(dt) if host.dtype != dt else host, order="C").view(bits_dtype(dt))
            idx = tuple(shard.index) if shard.index else ()
            mine.append((idx, bits))
            bits_now[(path, str(_ranges(idx, arr.shape)))] = bits
        local.append(mine)
    return local, bits_now


def _leaf_meta(
    leaves: list[tuple[str, jax.Array]], out_dtypes: list[np.dtype], everyone: list[list[list[dict]]]
) -> list[dict[str, Any]]:
    """The manifest's leaf entries from every process's shard entries (`everyone[process][leaf]`)."""
    leaf_meta: list[dict[str, Any]] = []
    for i, ((path, arr), dt) in enumerate(zip(leaves, out_dtypes)):
        shards = sorted((e for proc in everyone for e in proc[i]), key=lambda e: e["index"])
        leaf_meta.append(
            {
                "path": path,
                "dtype": dt.name,
                "shape": list(arr.shape),
                "key": f"leaves/{i}/",
                "shards": shards,
                "raw_bytes": int(np.prod(arr.shape)) * dt.itemsize,
                "stored_bytes": sum(int(sh["stored_bytes"]) for sh in shards),
            }
        )
    return leaf_meta


def publish_sharded(url: str, params: Any, version: int, *, dtype: str = "", context: ts.Context | None = None) -> dict:
    """Write `params` as snapshot `version` per shard (`ShardedWeightPublisher` for a single
    version). A collective: every process calls it with the same arguments. Returns the manifest."""
    return ShardedWeightPublisher(url, context=context).publish(params, version, dtype=dtype).manifest


__all__ = ["ShardedWeightPublisher", "publish_sharded"]
