"""Small host-side collectives for multi-process jobs: gather JSON from every process, broadcast
process 0's JSON or host arrays to all, a barrier; and `ProcessZeroWork`, which turns an error in
process 0's own work into an error on every process at the next point where they wait on it.

Every process of the job must make the same calls in the same order (they are collectives over
JAX's devices); with one process they return at once.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable
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
    "broadcast_arrays",
    "broadcast_json",
    "check_header",
    "failure_header",
]
