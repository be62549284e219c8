"""The publishing side of weight sync: `WeightPublisher` (one process writes whole leaves as base
snapshots plus XOR deltas), `rewind_store`, `open_publisher` (the publisher a trainer of this many
processes writes with: a `WeightPublisher`, or sharded.py's `ShardedWeightPublisher` per shard), and
the learner's glue, `store_publisher` / `published_copy` (every new policy version to
`rl.weight_store`). The store's layout and manifest are store.py's; subscriber.py reads it.

A `WeightPublisher` writes each policy version of a parameter pytree to the store as a *base* or a
*delta* against a parent version. The parent is the previous version (`delta_against="previous"`,
the default: a chain of deltas back to the latest base, each as small as one step's change) or the
latest base (`delta_against="base"`: one delta to read after the base, but it grows with every step
since the base). A new base is written once the stored bytes of the deltas since the latest base
reach ``new_base_fraction`` of the base's stored bytes (which also bounds what a subscriber joining
late reads: the base plus at most that fraction of it); with "previous", a delta against the
version before is written beside a new base, so a follower reads that instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
import tensorstore as ts

from composer_jax.config import ConfigError
from composer_jax.multihost import ProcessZeroWork
from composer_jax.weightsync.sharded import ShardedWeightPublisher
from composer_jax.weightsync.store import (
    Publisher,
    PublishInfo,
    Store,
    WeightSyncError,
    array_sha256,
    as_bits,
    check_new_base_fraction,
    host_leaves,
    next_version,
    open_store,
    publish_dtype,
    read_manifest,
    version_dir,
)
from composer_jax.weightsync.subscriber import VersionReader


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
        self.new_base_fraction = float(new_base_fraction)
        self.delta_against = delta_against
        self.store = open_store(url, context, zstd_level)
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
            base_v = int(read_manifest(self.store, self.latest)["base_version"])
            self._base_manifest = read_manifest(self.store, base_v)
            self._ref_version = self.latest if self.delta_against == "previous" else base_v
            self._ref = VersionReader(self.store).bits(self._ref_version)
            self._since_base = sum(
                read_manifest(self.store, v)["stored_bytes"] for v in self.store.versions() if base_v < v <= self.latest
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
        leaves = host_leaves(params, cast)
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
        vdir = version_dir(version)
        entries: list[dict[str, Any]] = []
        bits_by_path: dict[str, np.ndarray] = {}
        for i, (path, arr) in enumerate(leaves):
            bits = as_bits(arr)
            bits_by_path[path] = bits
            stored = bits ^ ref[path] if as_delta and ref is not None else bits
            nbytes = self.store.write_array(f"{vdir}leaves/{i}/", stored)
            entries.append(
                {
                    "path": path,
                    "dtype": arr.dtype.name,
                    "shape": list(arr.shape),
                    "key": f"leaves/{i}/",
                    "sha256": array_sha256(arr),
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


def rewind_store(store: Store, version: int) -> list[int]:
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
        vdir = version_dir(v)
        store.kv.delete_range(ts.KvStore.KeyRange(vdir, vdir[:-1] + chr(ord(vdir[-1]) + 1))).result()
    return gone


def open_publisher(
    url: str,
    *,
    process_count: int | None = None,
    new_base_fraction: float = 0.5,
    zstd_level: int = 3,
    context: ts.Context | None = None,
) -> Publisher:
    """The publisher a trainer of `process_count` processes (default: `jax.process_count()`)
    writes `url` with, the same call on every process: one process, a `WeightPublisher` (the whole
    tree copied to the host and written whole); several, a `ShardedWeightPublisher` (each process
    its own shards; `publish` is then a collective every process calls)."""
    n = jax.process_count() if process_count is None else process_count
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise WeightSyncError(f"process_count={process_count!r}; accepted: an int >= 1 (or None: this job's)")
    if n == 1:
        return WeightPublisher(url, new_base_fraction=new_base_fraction, zstd_level=zstd_level, context=context)
    return ShardedWeightPublisher(url, new_base_fraction=new_base_fraction, zstd_level=zstd_level, context=context)


def published_copy(params: Any, dtype: str) -> Any:
    """The host copy published to the weight store: floating leaves cast to `dtype` ("" = as is).
    With several processes every array is gathered to every process (a collective; the trainer
    publishes per shard instead, `store_publisher`). The single-writer reference of
    tests/support/publish_worker.py."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        host = multihost_utils.process_allgather(params, tiled=True)
    else:
        host = jax.device_get(params)
    if not dtype:
        return host
    return jax.tree.map(lambda x: x.astype(dtype) if np.issubdtype(x.dtype, np.floating) else x, host)


def store_publisher(
    store_url: str, *, resumed: bool, start: int, dtype: str, echo: Callable[[str], None]
) -> Callable[[Any, int], None]:
    """`publish(params, version)`, which every process of the trainer calls for every version (a
    collective), through `open_publisher`: one process copies the tree to the host and writes it
    with a `WeightPublisher`; several each write their own shards (`ShardedWeightPublisher`: no
    host gathers the model). On a resume the store is rewound to the checkpoint's version `start`
    first."""
    if not store_url:
        return lambda params, version: None
    # the store's versions before this run: every process reads them (a publish is a collective,
    # which all must skip or all take)
    try:
        stored = set(open_store(store_url).versions())
    except WeightSyncError as e:  # the URL the user gave: tensorstore cannot open or list it
        raise ConfigError(f"rl.weight_store={store_url!r}: {e}") from e
    if stored and (not resumed or (start not in stored and max(stored) > start)):
        raise ConfigError(
            f"rl.weight_store={store_url!r} holds versions {sorted(stored)[:5]}..{max(stored)} that are not this "
            f"run's ({'a fresh run' if not resumed else f'resumed at step {start}, a version it lacks'}); "
            "give an empty store (or remove it)"
        )
    # a trainer stopped after its last checkpoint: the versions it published since are a lost
    # lineage (its weights died with it); this run publishes those numbers anew. Process 0 rewinds,
    # the others wait for it (and stop with its error if the rewind fails).
    work = ProcessZeroWork()

    def rewind() -> None:
        gone = rewind_store(open_store(store_url), start)
        echo(f"[rl] weight store rewound to version {start}: versions {gone} were of the lost run")

    if stored and max(stored) > start:
        work.call("rewinding the weight store", rewind)
    work.share()
    publisher = open_publisher(store_url)  # one process: whole leaves; several: each its own shards

    def publish(params: Any, version: int) -> None:
        if version == start and start in stored:  # the checkpoint's own weights, published before it
            return
        publisher.publish(params, version, dtype=dtype)

    return publish
