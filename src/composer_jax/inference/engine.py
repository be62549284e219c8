"""The inference driver and the serving engine: one owner of a Sampler steps it; others talk to it.

`Driver` owns one Sampler and runs its cycles: between two decode steps it applies cancellations,
swaps weights, hands new requests to the sampler, runs one step and tells each request's listener
what happened:

  Event(tokens, logprobs, versions)   new tokens of a streaming request (read from
                                      `Sampler.running()` after the step)
  Event(completion=...)               the request finished (the whole Completion)
  Event(error=..., status=...)        the request failed; it is no longer in the driver

Its failure policy is the one of every front end (`Engine` here, the asyncio `AsyncSampler`):
failures never stop the driver. A request the sampler refuses (`submit` raises ValueError) gets
status 400. If a step raises, every request in the sampler fails with status 500 and a fresh
sampler is built (the old one's KV cache may have been donated to the failed program, so its state
is not trusted) with the weights in place before the latest swap when the failing step was the
first under new weights (the swap's future gets the exception when still pending). Failing only the
requests of the failed step, not the driver, is what a server must do (the next request may well
succeed) and what an RL run wants (a rollout that lost its completion is redone on the rebuilt
sampler instead of the run stopping).

`Engine`: one thread runs the driver; HTTP handlers (or any caller) `submit` requests with a
listener, `cancel` them, and `update_weights`; all three only queue work under a lock. Capacity:
at most `slots + max_queued` requests are in the engine; `submit` raises EngineFull beyond that
(the server's 429; max_queued None: no bound).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import math
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from composer_jax.inference.sampler import Completion, PrefixStats, Request, Sampler

_log = logging.getLogger("composer_jax.inference.engine")


class EngineFull(Exception):
    """No room for the requests: `slots + max_queued` are in the engine already."""


class EngineStopped(Exception):
    """The engine was stopped; it accepts nothing more."""


@dataclasses.dataclass
class Event:
    """What a listener hears about one request (module docstring)."""

    request_id: str
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    completion: Completion | None = None
    error: str | None = None
    status: int = 200


Listener = Callable[[Event], None]


@dataclasses.dataclass
class Job:
    """A request in a driver, with its listener; stream: report new tokens after every step;
    submitted: when it was handed in (`time.perf_counter`), the start of its time to first token."""

    request: Request
    listener: Listener
    stream: bool
    sent: int = 0  # tokens already reported
    submitted: float = dataclasses.field(default_factory=time.perf_counter)


@dataclasses.dataclass
class Swap:
    """New weights for the next step; the future resolves to the version they replace."""

    params: Any
    version: int
    future: concurrent.futures.Future


class Driver:
    """Owns the Sampler that `new_sampler(params, version)` builds (again after a failure) and runs
    its cycles (module docstring); `left(n)` is told of every n jobs that leave it (finished,
    failed, cancelled); `first_token(seconds)`, when set (before any job is submitted: a server sets
    it as it starts), of every job's time from submission to the end of the step that produced its
    first token (its prefill). Runs in one thread at a time."""

    def __init__(
        self,
        new_sampler: Callable[[Any, int], Sampler],
        params: Any,
        version: int,
        *,
        left: Callable[[int], None] = lambda n: None,
        first_token: Callable[[float], None] | None = None,
    ):
        self._new_sampler = new_sampler
        self.sampler = new_sampler(params, version)
        self._left = left
        self.first_token = first_token
        # jobs without a first token yet, in submission order: the sampler admits first come first
        # served, so the requests a step admitted are the first live ones here (cancelled and failed
        # jobs are skipped when they come to the front)
        self._unstarted: collections.deque[Job] = collections.deque()
        self.jobs: dict[str, Job] = {}  # in the sampler
        self.steps = 0
        self.failures = 0
        # occupancy: requests decoded summed over steps (slot_steps / (steps x slots) is the mean
        # share of slots busy in a decode step) and the seconds spent inside steps and weight swaps
        self.slot_steps = 0
        self.step_s = 0.0
        self.swap_s = 0.0
        self.swaps = 0  # weight versions swapped in
        self._prefix_before = PrefixStats()  # the prefix counters of samplers replaced after a failure
        self._generated_before = 0  # tokens generated by samplers replaced after a failure
        self._before: tuple[Any, int] | None = None  # the weights before the latest swap
        self._verified = True  # a step has run with the current weights
        self._previous = version  # the version before the pending swaps
        self._unverified: list[Swap] = []

    @property
    def busy(self) -> bool:
        return self.sampler.busy

    @property
    def prefix_stats(self) -> PrefixStats:
        """Admissions and prompt tokens reused from cached prefixes or prefilled, over the driver's life."""
        return self._prefix_before + self.sampler.prefix_stats

    @property
    def tokens_generated(self) -> int:
        """Tokens generated over the driver's life (cancelled and failed requests' included)."""
        return self._generated_before + self.sampler.tokens_generated

    def finish(self, job: Job, event: Event) -> None:
        """`job` leaves the driver with `event`."""
        self.jobs.pop(job.request.id, None)
        self._left(1)
        try:
            job.listener(event)
        except Exception:  # a listener's bug must not stop the driver
            _log.exception("listener of %s failed", job.request.id)

    def cycle(self, inbox: list[Job], cancels: Sequence[str], swaps: Sequence[Swap]) -> None:
        """Cancellations (of jobs in the sampler or in `inbox`), weight swaps, new jobs, then one
        step when anything is to run, its events reported."""
        for rid in cancels:
            job = self.jobs.pop(rid, None) or next((j for j in inbox if j.request.id == rid), None)
            if job is None:
                continue
            if job in inbox:
                inbox.remove(job)
            self.sampler.cancel(rid)
            self._left(1)
        t0 = time.perf_counter()
        for swap in swaps:
            self._before, self._verified = (self.sampler.params, self.sampler.version), False
            self.sampler.update_weights(swap.params, swap.version)
            self._unverified.append(swap)
            self.swaps += 1
        self.swap_s += time.perf_counter() - t0
        for job in inbox:
            try:
                self.sampler.submit(job.request)
            except ValueError as e:
                self.finish(job, Event(job.request.id, error=str(e), status=400))
                continue
            self.jobs[job.request.id] = job
            if self.first_token is not None:
                self._unstarted.append(job)
        if not self.sampler.busy:
            # nothing to run the new weights on: the swap is done (a failure of its first step
            # later still puts the weights before it back)
            self._resolve_swaps()
            return
        decoding = min(len(self.jobs), self.sampler.slots)  # waiting requests fill free slots first
        waiting = self.sampler.waiting if self._unstarted else 0
        t0 = time.perf_counter()
        try:
            done = self.sampler.step()
        except Exception as e:
            self._recover(e)
            return
        self.step_s += time.perf_counter() - t0
        self.steps += 1
        self.slot_steps += decoding
        self._verified = True
        self._resolve_swaps()
        if self._unstarted:
            self._started(waiting - self.sampler.waiting)
        self._report(done)

    def _started(self, admitted: int) -> None:
        """Tell `first_token` of the `admitted` jobs that got their first token (prefill) in the
        step just run; before `_report`, while those that finished in it are still in `jobs`. Work
        per step: the jobs admitted and the dead ones skipped, not the queue."""
        now, report, queue = time.perf_counter(), self.first_token, self._unstarted
        while admitted > 0 and queue:
            job = queue.popleft()
            if self.jobs.get(job.request.id) is not job:  # cancelled or failed before admission
                continue
            admitted -= 1
            if report is not None:
                report(now - job.submitted)

    def fail_all(self, message: str, status: int) -> None:
        """Every job in the driver fails with `message`."""
        for job in list(self.jobs.values()):
            self.finish(job, Event(job.request.id, error=message, status=status))

    def _resolve_swaps(self) -> None:
        for swap in self._unverified:
            if not swap.future.done():
                swap.future.set_result(self._previous)
        if self._unverified:
            self._previous = self.sampler.version
        self._unverified = []

    def _report(self, done: list[Completion]) -> None:
        finished = {c.id for c in done}
        if any(j.stream for j in self.jobs.values()):
            for rid, (tokens, logprobs, versions) in self.sampler.running().items():
                job = self.jobs.get(rid)
                if job is None or not job.stream or rid in finished or len(tokens) <= job.sent:
                    continue
                n, job.sent = job.sent, len(tokens)
                try:
                    job.listener(Event(rid, tokens[n:], logprobs[n:], versions[n:]))
                except Exception:
                    _log.exception("listener of %s failed", rid)
        for c in done:
            job = self.jobs.get(c.id)
            if job is not None:
                self.finish(job, Event(c.id, completion=c))

    def _recover(self, exc: Exception) -> None:
        self.failures += 1
        _log.error("a sampler step failed; failing %d requests:\n%s", len(self.jobs), traceback.format_exc())
        params, version = self.sampler.params, self.sampler.version
        if not self._verified and self._before is not None:  # new weights failed their first step
            params, version = self._before
            self._verified = True
            _log.error(
                "weights of version %d failed in their first step; back to version %d", self.sampler.version, version
            )
            for swap in self._unverified:
                if not swap.future.done():
                    swap.future.set_exception(exc)
            self._unverified = []
            self._previous = version
        message = (
            f"the inference engine failed while this request ran ({type(exc).__name__}: {str(exc)[:300]}); "
            "the request was dropped and the engine keeps serving"
        )
        try:  # before the requests learn of the failure, so a client that retries meets the old weights
            prefix, generated = self.prefix_stats, self.tokens_generated
            self.sampler = self._new_sampler(params, version)
            self._prefix_before, self._generated_before = prefix, generated
        except Exception:  # keep the old object; the next step will fail and report again
            _log.exception("rebuilding the sampler failed")
        self.fail_all(message, 500)


class Engine:
    """new_sampler(params, version) -> Sampler builds the sampler (again after a failure); a thread
    runs its `Driver`."""

    def __init__(
        self, new_sampler: Callable[[Any, int], Sampler], params: Any, version: int, *, max_queued: int | None
    ):
        if max_queued is not None and max_queued < 0:
            raise ValueError(f"max_queued={max_queued} must be >= 0, or None for no bound")
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
