"""Small host-side collectives for multi-process jobs: gather JSON from every process, broadcast
process 0's JSON to all, scatter process 0's host arrays to the processes that hold their rows
(`scatter_arrays`), a barrier; and `ProcessZeroWork`, which turns an error in process 0's own work
into an error on every process at the next point where they wait on it.

Every process of the job must make the same calls in the same order (they are collectives over
JAX's devices); with one process they return at once.
"""

from __future__ import annotations

import functools
import inspect
import json
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import PartitionSpec as P


def allgather_json(obj: Any) -> list[Any]:
    """Every process's `obj` (JSON-able), in process order."""
    if jax.process_count() == 1:
        return [obj]
    from jax.experimental import multihost_utils

    raw = np.frombuffer(json.dumps(obj).encode(), np.uint8)
    lengths = np.asarray(multihost_utils.process_allgather(np.array([raw.size], np.int32))).reshape(-1)
    buf = np.zeros(int(lengths.max()), np.uint8)
    buf[: raw.size] = raw
    gathered = np.asarray(multihost_utils.process_allgather(buf)).reshape(len(lengths), -1)
    return [json.loads(bytes(row[:n])) for row, n in zip(gathered, lengths)]


def broadcast_json(obj: Any) -> Any:
    """Process 0's `obj` (JSON-able) on every process; the others' `obj` is ignored."""
    if jax.process_count() == 1:
        return obj
    from jax.experimental import multihost_utils

    raw = np.frombuffer(json.dumps(obj).encode(), np.uint8) if jax.process_index() == 0 else np.zeros(0, np.uint8)
    size = int(np.asarray(multihost_utils.broadcast_one_to_all(np.array([raw.size], np.int32)))[0])
    buf = np.zeros(size, np.uint8)
    buf[: raw.size] = raw
    return json.loads(bytes(np.asarray(multihost_utils.broadcast_one_to_all(buf))))


def _blocks(sharding: jax.sharding.NamedSharding, shape: tuple[int, ...]) -> dict[int, dict[tuple, list]]:
    """Per process: each distinct block (its index, as a hashable tuple of (start, stop)) of an
    array of `shape` under `sharding` that the process's devices hold, with those devices (mesh
    order, the same on every process)."""
    index = sharding.devices_indices_map(shape)
    out: dict[int, dict[tuple, list]] = {}
    for d in sharding.mesh.devices.flat:
        key = tuple(sl.indices(n)[:2] for sl, n in zip(index[d], shape))
        out.setdefault(d.process_index, {}).setdefault(key, []).append(d)
    return out


@functools.cache
def _permute(mesh: jax.sharding.Mesh, pairs: tuple[tuple[int, int], ...]) -> Callable[[Any], Any]:
    """jitted: each device's block to its pair's destination (a collective permute over the
    one-axis `mesh`); devices that receive nothing get zeros."""
    spec = P("all")
    return jax.jit(
        jax.shard_map(lambda tree: jax.lax.ppermute(tree, "all", pairs), mesh=mesh, in_specs=spec, out_specs=spec)
    )


def scatter_arrays(
    arrays: dict[str, np.ndarray] | None, sharding: jax.sharding.NamedSharding
) -> tuple[dict[str, jax.Array], list[int]]:
    """Process 0's dict of host arrays (the others pass None) as global arrays of `sharding`, each
    process receiving only the blocks its devices hold.

    Shapes and dtypes travel first as JSON. Process 0 puts its own blocks on its devices; for each
    other process it places that process's distinct blocks on its own devices (one per device,
    several rounds if it has fewer) and a collective permute over every device of the mesh moves
    each to one device of the receiving process, point to point (the other devices exchange
    nothing: they pass and get zeros made in place); a block two devices of one process hold (a
    replicated mesh axis) crosses once and is copied there. Returns the arrays and the bytes each
    process received (process 0: none)."""
    lead = jax.process_index() == 0
    if lead:
        if arrays is None:
            raise ValueError("scatter_arrays: process 0 must pass the arrays")
        host = {k: np.asarray(v) for k, v in arrays.items()}
        specs = broadcast_json({k: [list(v.shape), str(v.dtype)] for k, v in host.items()})
    else:
        specs = broadcast_json(None)
    me, devices = jax.process_index(), list(sharding.mesh.devices.flat)
    position = {d: i for i, d in enumerate(devices)}
    mesh = jax.sharding.Mesh(np.array(devices), ("all",))
    sources = [d for d in devices if d.process_index == 0]
    received = [0] * jax.process_count()
    got: dict[str, dict[tuple, jax.Array]] = {k: {} for k in specs}
    # rounds: (receiving process, round) -> key -> (block indices, block shape, dtype, receiving devices)
    rounds: dict[tuple[int, int], dict[str, tuple[list[tuple], tuple[int, ...], np.dtype, list]]] = {}
    for k, (shape_list, dtype_name) in specs.items():
        shape, dtype = tuple(shape_list), np.dtype(dtype_name)
        for p, blocks in sorted(_blocks(sharding, shape).items()):
            keys = list(blocks)
            if p == 0:
                if lead:
                    for c in keys:
                        got[k][c] = jax.device_put(host[k][tuple(slice(a, b) for a, b in c)], blocks[c][0])
                continue
            for n, first in enumerate(range(0, len(keys), len(sources))):  # rounds if process 0 has fewer devices
                chunk = keys[first : first + len(sources)]
                block_shape = tuple(b - a for a, b in chunk[0])
                if any(tuple(b - a for a, b in c) != block_shape for c in chunk):
                    raise ValueError(f"scatter_arrays: uneven blocks of {k!r} {shape} under {sharding.spec}")
                rounds.setdefault((p, n), {})[k] = (chunk, block_shape, dtype, [blocks[c][0] for c in chunk])
                received[p] += len(chunk) * int(np.prod(block_shape)) * dtype.itemsize
    for (p, _), parts in rounds.items():  # the same order on every process
        pairs = None
        staged: dict[str, jax.Array] = {}
        for k, (chunk, block_shape, dtype, dst) in parts.items():
            pk = tuple((position[sources[j]], position[d]) for j, d in enumerate(dst))
            if pairs is not None and pk != pairs:
                raise ValueError(f"scatter_arrays: {k!r} is laid out unlike the other arrays under {sharding.spec}")
            pairs = pk
            src_block = dict(zip(sources, chunk))
            local = []
            for d in devices:
                if d.process_index != me:
                    continue
                if lead and d in src_block:
                    block = host[k][tuple(slice(a, b) for a, b in src_block[d])][None]
                else:
                    block = np.zeros((1, *block_shape), dtype)
                local.append(jax.device_put(block, d))
            staged[k] = jax.make_array_from_single_device_arrays(
                (len(devices), *block_shape), jax.sharding.NamedSharding(mesh, P("all")), local
            )
        assert pairs is not None
        moved = _permute(mesh, pairs)(staged)
        if p != me:
            continue
        for k, (chunk, _, _, dst) in parts.items():
            by_device = {s.device: s.data for s in moved[k].addressable_shards}
            for c, d in zip(chunk, dst):
                got[k][c] = by_device[d].reshape(by_device[d].shape[1:])
    out: dict[str, jax.Array] = {}
    for k, (shape_list, _) in specs.items():
        shape = tuple(shape_list)
        shards = []
        for c, devs in _blocks(sharding, shape).get(me, {}).items():
            shards.append(got[k][c])
            shards.extend(jax.device_put(got[k][c], d) for d in devs[1:])  # replicas within the process
        out[k] = jax.make_array_from_single_device_arrays(shape, sharding, shards)
    return out, received


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier of this name."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


class ProcessZeroFailed(RuntimeError):
    """Raised on the other processes when process 0 reports that its own work failed."""


class ProcessZeroWork:
    """Process 0's own work (no collective: a rollout side, evaluations, file clean-up) in a job of
    several processes, and the points where the others wait on it (`share`).

    An error in process 0's work cannot simply be raised there: the others would wait in their next
    collective until JAX's coordination service (on process 0) goes away. So `run` keeps the error
    (and skips process 0's later work), process 0 keeps entering the collectives every process
    enters, and at the next `share` it hands the others the error instead of its header: they raise
    `ProcessZeroFailed` with its message, process 0 raises the error itself. With one process `run`
    raises at once and `share` returns the header.

    `before_share` runs on every process before each share (the trainer waits for an asynchronous
    checkpoint commit there: its barrier must not interleave with the broadcast); `broadcast` is
    the collective (process 0's JSON on every process: `broadcast_json`).
    """

    def __init__(
        self,
        *,
        lead: bool | None = None,
        multi: bool | None = None,
        before_share: Callable[[], None] = lambda: None,
        broadcast: Callable[[Any], Any] = broadcast_json,
    ):
        self.lead = jax.process_index() == 0 if lead is None else lead
        self.multi = jax.process_count() > 1 if multi is None else multi
        self.before_share, self.broadcast = before_share, broadcast
        self.failed: tuple[str, Exception] | None = None  # (where, error) of process 0, not yet shared

    async def run(self, where: str, work: Callable[..., Any], *args: Any) -> Any:
        """`work(*args)` (awaited when it returns an awaitable) on process 0 unless its work already
        failed; None on the others (and on process 0 once failed). `where` names the work in the
        message the others get."""
        if not self.lead or self.failed is not None:
            return None
        try:
            out = work(*args)
            return await out if inspect.isawaitable(out) else out
        except Exception as exc:
            self._keep(where, exc)
            return None

    def call(self, where: str, work: Callable[..., Any], *args: Any) -> Any:
        """`run` for synchronous work."""
        if not self.lead or self.failed is not None:
            return None
        try:
            return work(*args)
        except Exception as exc:
            self._keep(where, exc)
            return None

    def _keep(self, where: str, exc: Exception) -> None:
        if not self.multi:
            raise exc
        self.failed = (where, exc)

    def share(self, header: dict[str, Any] | None = None) -> dict[str, Any]:
        """A collective (blocking; every process calls it at the same point): process 0's `header`
        on every process, or, when process 0's work failed, that error raised on every process."""
        if not self.multi:
            if self.failed is not None:
                raise self.failed[1]
            return dict(header or {})
        self.before_share()
        if self.lead:
            if self.failed is not None:
                where, exc = self.failed
                self.broadcast(failure_header(where, exc))
                raise exc
            return self.broadcast({"error": "", **(header or {})})
        return check_header(self.broadcast(None))


def failure_header(where: str, exc: BaseException) -> dict[str, Any]:
    """The header process 0 sends instead of its own when its work at `where` failed."""
    return {"error": f"{type(exc).__name__}: {exc}", "where": where}


def check_header(header: dict[str, Any]) -> dict[str, Any]:
    """`header` from process 0, or `ProcessZeroFailed` with its error when it carries one."""
    if header.get("error"):
        raise ProcessZeroFailed(f"{header.get('where', '?')}: process 0 stopped the run: {header['error']}")
    return header


__all__ = [
    "ProcessZeroFailed",
    "ProcessZeroWork",
    "allgather_json",
    "barrier",
    "broadcast_json",
    "check_header",
    "failure_header",
    "scatter_arrays",
]
