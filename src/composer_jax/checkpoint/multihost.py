"""Small host-side collectives for multi-process jobs: gather JSON from every process, a barrier.

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


def barrier(name: str) -> None:
    """Wait until every process reaches the barrier of this name."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


__all__ = ["allgather_json", "barrier"]
