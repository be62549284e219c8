"""Small host-side collectives for multi-process jobs: gather JSON from every process, broadcast
process 0's JSON or host arrays to all, a barrier.

Every process of the job must make the same calls in the same order (they are collectives over
JAX's devices); with one process they return at once.
"""

from __future__ import annotations

import json
from typing import Any

import jax
import numpy as np


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


def broadcast_arrays(arrays: dict[str, np.ndarray] | None) -> dict[str, np.ndarray]:
    """Process 0's dict of host arrays on every process (the others pass None): the shapes and
    dtypes first (JSON), then the data in one all-reduce from process 0."""
    if jax.process_count() == 1:
        assert arrays is not None
        return arrays
    from jax.experimental import multihost_utils

    if jax.process_index() == 0:
        if arrays is None:
            raise ValueError("broadcast_arrays: process 0 must pass the arrays")
        local = {k: np.asarray(v) for k, v in arrays.items()}
        broadcast_json({k: [list(v.shape), str(v.dtype)] for k, v in local.items()})
    else:
        specs = broadcast_json(None)
        local = {k: np.zeros(shape, dtype) for k, (shape, dtype) in specs.items()}
    out = multihost_utils.broadcast_one_to_all(local)
    return {k: np.asarray(v) for k, v in out.items()}


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier of this name."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


__all__ = ["allgather_json", "barrier", "broadcast_arrays", "broadcast_json"]
