"""Per-shard weight publishing: every trainer process writes the shards it holds, no host gathers.

`publish_sharded(url, params, version)` is called by every process of a multi-host trainer with the
same global `jax.Array` tree. Each leaf becomes one zarr3 array of the full shape under
`versions/<v>/leaves/<i>/`, chunked by the leaf's shard shape, and each process writes only the
shards it holds with `replica_id == 0` (a replicated shard is written once, by the process holding
its first replica), so no chunk has two writers. The manifest (format 2, kind "sharded") lists, per
leaf, every shard's index ranges and the sha256 of its bytes; the processes' shard entries are
gathered as JSON (a few hundred bytes per shard), process 0 writes the manifest and then `latest`.

The store layout is the weight-sync store's (checkpoint/weight_sync.py): a `WeightSubscriber`
reads a sharded version into the full tree (every shard checksummed), a `WeightPublisher` may
continue the store with deltas against it, and `read_shard` reads only the index ranges a reader
asks for (a serving shard loading its own slice). A sharded version is always a full snapshot:
per-shard XOR deltas are not built.
"""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from composer_jax.checkpoint.multihost import allgather_json, barrier
from composer_jax.checkpoint.weight_sync import (
    SHARDED_FORMAT,
    WeightSyncError,
    open_store,
    read_manifest,
    version_dir,
)


def _leaves(tree: Any, prefix: str = "") -> list[tuple[str, jax.Array]]:
    if isinstance(tree, dict):
        out: list[tuple[str, jax.Array]] = []
        for k in sorted(tree):
            if not isinstance(k, str) or not k or "/" in k:
                raise WeightSyncError(
                    f"pytree key {k!r} at {prefix or '<root>'!r}: keys must be non-empty str without '/'"
                )
            out += _leaves(tree[k], f"{prefix}/{k}" if prefix else k)
        return out
    if isinstance(tree, jax.Array):
        return [(prefix, tree)]
    raise WeightSyncError(
        f"pytree node at {prefix or '<root>'!r} is a {type(tree).__name__}; accepted: dict or jax.Array"
    )


def _ranges(index: tuple[slice, ...], shape: tuple[int, ...]) -> list[list[int]]:
    return [list(sl.indices(n)[:2]) for sl, n in zip(index, shape)]


def _uint(dtype: np.dtype) -> np.dtype:
    return np.dtype(f"uint{8 * dtype.itemsize}")


def publish_sharded(url: str, params: Any, version: int, *, dtype: str = "", context: ts.Context | None = None) -> dict:
    """Write `params` (a dict tree of global jax.Arrays, the same on every process) as `version`,
    each process writing its own replica-0 shards; floating leaves are cast to `dtype` first ("" =
    as is). A collective: every process calls it with the same arguments. Returns the manifest."""
    store = open_store(url, context)
    leaves = _leaves(params)
    if not leaves:
        raise WeightSyncError("params has no array leaves; nothing to publish")
    pi = jax.process_index()
    latest = store.latest()
    if (
        isinstance(version, bool)
        or not isinstance(version, int)
        or version < 0
        or (latest is not None and version <= latest)
    ):
        raise WeightSyncError(f"version={version!r}; accepted: an int > latest version {latest} (>= 0)")
    vdir = version_dir(version)
    out_dtypes = []
    for _, arr in leaves:
        dt = np.dtype(arr.dtype)
        if dtype and np.issubdtype(dt, np.floating):
            dt = np.dtype(jax.numpy.dtype(dtype))
        if dt.itemsize not in (1, 2, 4, 8):
            raise WeightSyncError(f"dtype {dt} of itemsize {dt.itemsize}; accepted itemsizes: 1, 2, 4, 8")
        out_dtypes.append(dt)
    specs = []
    for i, ((_, arr), dt) in enumerate(zip(leaves, out_dtypes)):
        chunk = list(arr.sharding.shard_shape(arr.shape))
        specs.append(store.array_spec(f"{vdir}leaves/{i}/", _uint(dt), list(arr.shape), chunk))
    if pi == 0:  # one creator per array; the others open it after the barrier
        for spec in specs:
            ts.open(spec, create=True, delete_existing=True, context=store.context).result()
    barrier(f"composer_jax_publish_sharded_create_{version}")
    mine: list[list[dict]] = []
    for (_, arr), dt, spec in zip(leaves, out_dtypes, specs):
        target = ts.open({k: v for k, v in spec.items() if k != "metadata"}, open=True, context=store.context).result()
        entries, writes = [], []
        for shard in arr.addressable_shards:
            if shard.replica_id != 0:
                continue
            host = np.asarray(shard.data)
            bits = np.ascontiguousarray(host.astype(dt) if host.dtype != dt else host).view(_uint(dt))
            idx = shard.index if shard.index else ()
            writes.append(target[idx].write(bits) if idx else target.write(bits))
            entries.append(
                {
                    "index": _ranges(idx, arr.shape),
                    "sha256": hashlib.sha256(bits.tobytes()).hexdigest(),
                    "process": pi,
                }
            )
        for w in writes:
            w.result()
        mine.append(entries)
    everyone = allgather_json(mine)
    if pi == 0:
        leaf_entries: list[dict[str, Any]] = []
        raw_total = stored_total = 0
        for i, ((path, arr), dt) in enumerate(zip(leaves, out_dtypes)):
            shards = sorted((e for proc in everyone for e in proc[i]), key=lambda e: e["index"])
            key = f"leaves/{i}/"
            raw = int(np.prod(arr.shape)) * dt.itemsize
            stored = store.stored_bytes(vdir + key)
            raw_total, stored_total = raw_total + raw, stored_total + stored
            leaf_entries.append(
                {
                    "path": path,
                    "dtype": dt.name,
                    "shape": list(arr.shape),
                    "key": key,
                    "shards": shards,
                    "raw_bytes": raw,
                    "stored_bytes": stored,
                }
            )
        manifest = {
            "format": SHARDED_FORMAT,
            "version": version,
            "kind": "sharded",
            "base_version": version,
            "parent_version": version,
            "raw_bytes": raw_total,
            "stored_bytes": stored_total,
            "leaves": leaf_entries,
        }
        store.write_json(vdir + "manifest.json", manifest)
        store.write_json("latest", {"version": version})
    barrier(f"composer_jax_publish_sharded_done_{version}")
    return read_manifest(store, version)


def read_shard(
    url: str, version: int, path: str, index: tuple[slice, ...], *, context: ts.Context | None = None
) -> np.ndarray:
    """Only the index ranges `index` of leaf `path` in sharded `version` (a serving shard loading its
    slice). Every stored shard the request overlaps is read whole and checked against its sha256."""
    store = open_store(url, context)
    m = read_manifest(store, version)
    if m["kind"] != "sharded":
        raise WeightSyncError(f"version {version} in {store.url} is a {m['kind']!r}; read_shard reads 'sharded' ones")
    lf = next((x for x in m["leaves"] if x["path"] == path), None)
    if lf is None:
        raise WeightSyncError(f"version {version} has no leaf {path!r}; leaves: {[x['path'] for x in m['leaves']][:8]}")
    shape = tuple(lf["shape"])
    want = [range(*sl.indices(n)) for sl, n in zip(index, shape)] + [range(n) for n in shape[len(index) :]]
    if len(index) > len(shape) or any(r.step != 1 for r in want):
        raise WeightSyncError(f"index {index!r} for leaf {path!r} of shape {list(shape)}; accepted: unit-step slices")
    dt = np.dtype(jax.numpy.dtype(lf["dtype"]))
    arr = ts.open(
        {"driver": "zarr3", "kvstore": store.url + version_dir(version) + lf["key"]}, open=True, context=store.context
    ).result()
    out = np.zeros([len(r) for r in want], _uint(dt))
    covered = 0
    for sh in lf["shards"]:
        rng = [range(a, b) for a, b in sh["index"]]
        lo = [max(r.start, w.start) for r, w in zip(rng, want)]
        hi = [min(r.stop, w.stop) for r, w in zip(rng, want)]
        if any(a >= b for a, b in zip(lo, hi)):
            continue
        bits = np.asarray(arr[tuple(slice(r.start, r.stop) for r in rng)].read().result(), order="C")
        if hashlib.sha256(bits.tobytes()).hexdigest() != sh["sha256"]:
            raise WeightSyncError(f"checksum mismatch for shard {sh['index']} of leaf {path!r}, version {version}")
        src = tuple(slice(a - r.start, b - r.start) for a, b, r in zip(lo, hi, rng))
        dst = tuple(slice(a - w.start, b - w.start) for a, b, w in zip(lo, hi, want))
        out[dst] = bits[src]
        covered += int(np.prod([b - a for a, b in zip(lo, hi)]))
    if covered != out.size:
        raise WeightSyncError(f"the shards of leaf {path!r} in version {version} do not cover {index!r}")
    return out.view(dt)


__all__ = ["publish_sharded", "read_shard"]
