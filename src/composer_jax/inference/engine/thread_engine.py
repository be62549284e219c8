"""The serving engine: a `Driver` run by a thread of its own, fed from any other thread.

`Engine`: one thread runs the driver; HTTP handlers (or any caller) `submit` requests with a
listener, `cancel` them, and `update_weights`; all three only queue work under a lock. Capacity:
at most `slots + max_queued` requests are in the engine; `submit` raises EngineFull beyond that
(the server's 429; max_queued None: no bound).
"""

from __future__ import annotations

import concurrent.futures
import math
import threading
from collections.abc import Callable, Sequence
from typing import Any

from composer_jax.errors import ConfigError
from composer_jax.inference.engine.batch_sampler import PrefixStats, Request, Sampler
from composer_jax.inference.engine.driver import Driver, Event, Job, Listener, Swap


class EngineFull(Exception):
    """No room for the requests: `slots + max_queued` are in the engine already."""


class EngineStopped(Exception):
    """The engine was stopped; it accepts nothing more."""


class Engine:
    """new_sampler(params, version) -> Sampler builds the sampler (again after a failure); a thread
    runs its `Driver`."""

    def __init__(
        self, new_sampler: Callable[[Any, int], Sampler], params: Any, version: int, *, max_queued: int | None
    ):
        if max_queued is not None and max_queued < 0:
            raise ConfigError(f"max_queued={max_queued} must be >= 0, or None for no bound")
        self._cond = threading.Condition()
        self.driver = Driver(new_sampler, params, version, left=self._left)
        self.max_queued = max_queued
        self.capacity = math.inf if max_queued is None else self.sampler.slots + max_queued
        self._inbox: list[Job] = []
        self._cancels: list[str] = []
        self._swaps: list[Swap] = []
        self._outstanding = 0  # submitted and not yet finished, failed or cancelled
        self._stop = False
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ other threads
    @property
    def sampler(self) -> Sampler:
        return self.driver.sampler

    @property
    def version(self) -> int:
        return self.sampler.version

    @property
    def outstanding(self) -> int:
        return self._outstanding

    @property
    def prefix_stats(self) -> PrefixStats:
        """Admissions and prompt tokens reused from cached prefixes or prefilled, over the engine's life."""
        return self.driver.prefix_stats

    @property
    def steps(self) -> int:
        return self.driver.steps

    @property
    def failures(self) -> int:
        return self.driver.failures

    @property
    def slot_steps(self) -> int:
        return self.driver.slot_steps

    @property
    def step_s(self) -> float:
        return self.driver.step_s

    @property
    def prefill_s(self) -> float:
        return self.driver.prefill_s

    @property
    def prefill_trace_s(self) -> float:
        return self.driver.prefill_trace_s

    @property
    def swap_s(self) -> float:
        return self.driver.swap_s

    @property
    def swaps(self) -> int:
        return self.driver.swaps

    @property
    def tokens_generated(self) -> int:
        return self.driver.tokens_generated

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="composer-jax-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = 30.0) -> None:
        """Stop after the current step; requests still in the engine fail with status 503."""
        with self._cond:
            self._stop = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    def submit(self, requests: Sequence[Request], listener: Listener, *, stream: bool = False) -> None:
        """Queue requests (all or none: EngineFull when they do not all fit). Each needs a unique id."""
        with self._cond:
            if self._stop:
                raise EngineStopped("the engine is stopped")
            if self._outstanding + len(requests) > self.capacity:
                raise EngineFull(
                    f"{self._outstanding} requests are in the server and {len(requests)} more do not fit "
                    f"(capacity {self.capacity} = {self.sampler.slots} slots + max_queued {self.max_queued})"
                )
            self._outstanding += len(requests)
            self._inbox.extend(Job(r, listener, stream) for r in requests)
            self._cond.notify()

    def cancel(self, request_ids: Sequence[str]) -> None:
        """Drop requests (e.g. the client went away); their listeners hear nothing more."""
        with self._cond:
            self._cancels.extend(request_ids)
            self._cond.notify()

    def update_weights(self, params: Any, version: int) -> concurrent.futures.Future:
        """Swap the weights between two steps; the future resolves to the previous version once a
        step has run with the new weights (at once when nothing is running), or gets the exception
        of that step. Whenever the first step under new weights fails, the weights before them are
        put back."""
        swap = Swap(params, version, concurrent.futures.Future())
        with self._cond:
            if self._stop:
                raise EngineStopped("the engine is stopped")
            self._swaps.append(swap)
            self._cond.notify()
        return swap.future

    # ------------------------------------------------------------------ the engine thread
    def _left(self, n: int) -> None:
        with self._cond:
            self._outstanding -= n

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._stop or self._inbox or self._cancels or self._swaps or self.driver.busy):
                    self._cond.wait()
                if self._stop:
                    break
                inbox, self._inbox = self._inbox, []
                cancels, self._cancels = self._cancels, []
                swaps, self._swaps = self._swaps, []
            self.driver.cycle(inbox, cancels, swaps)
        self.driver.fail_all("the server is shutting down", 503)
        for job in self._inbox:
            self.driver.finish(job, Event(job.request.id, error="the server is shutting down", status=503))
