"""The learner's processes: what process 0 does alone, and every point where all processes meet.

A trainer of several JAX processes runs its rollout side (environment client, samplers, queue,
group store, evaluations) on process 0 only; every process trains. The points where they meet,
each a collective every process enters in the same order, are all here or named here:

1. `share` (process 0's JSON header on every process, or its error raised on every one): the end
   of the setup, each step's header (the ids it trains, the ids finished untrained, the logged
   values), the end of the run;
2. `batch` (process 0's host batch as arrays on the mesh: each process receives only its rows,
   `checkpoint.multihost.scatter_arrays`);
3. the train step itself (a jitted program over the global mesh), the reference log-probs;
4. the weight publish (`weightsync/publisher.py`: every process writes its shards of each version);
5. the checkpoint save and its commit (orbax; `before_share` waits for the commit so its barrier,
   a collective in orbax's own thread, never interleaves with a share).

With one process every method is the plain local operation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from composer_jax.multihost import ProcessZeroWork, scatter_arrays


class Hosts:
    """This process's place in the trainer (`lead`: process 0, `multi`: several processes), process
    0's own work (`run`, `call`: an error in it reaches every process at the next `share`), and the
    collectives `share` and `batch` (module docstring)."""

    def __init__(self, *, before_share: Callable[[], None] = lambda: None):
        self.lead, self.multi = jax.process_index() == 0, jax.process_count() > 1
        self.work = ProcessZeroWork(before_share=before_share)

    async def run(self, where: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Process 0's work `fn(*args)` (awaited if it returns an awaitable); None on the others."""
        return await self.work.run(where, fn, *args)

    def call(self, where: str, fn: Callable[..., Any], *args: Any) -> Any:
        """`run` for synchronous work."""
        return self.work.call(where, fn, *args)

    async def share(self, header: dict[str, Any] | None = None) -> dict[str, Any]:
        """Collective 1: process 0's `header` on every process (in a thread: the event loop keeps
        sampling)."""
        return await asyncio.to_thread(self.work.share, header)

    def batch(self, host: dict[str, np.ndarray] | None, sharding) -> tuple[dict[str, jax.Array], dict[str, float]]:
        """Collective 2: process 0's host batch (None on the others) as arrays on the mesh, and the
        bytes moved: the whole batch, and (several processes) the most any process received."""
        if not self.multi:
            assert host is not None
            batch = {k: jax.device_put(v, sharding) for k, v in host.items()}
            return batch, {"batch/bytes": float(sum(v.nbytes for v in host.values()))}
        batch, received = scatter_arrays(host, sharding)
        return batch, {
            "batch/bytes": float(sum(v.nbytes for v in batch.values())),
            "batch/received_bytes_max": float(max(received)),
        }
