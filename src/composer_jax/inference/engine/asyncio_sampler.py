"""asyncio front end for one Sampler: many coroutines await completions; one driver steps.

Rollout workers are coroutines: each awaits a completion, then its environment's tool calls, then
the next completion. `AsyncSampler.generate` queues a request and awaits it. A single task of the
event loop runs the same `driver.Driver` the serving engine runs: between two decode steps it hands
it the pending weight update and the queued requests, and the driver's cycle (submissions, one
`Sampler.step`) runs in a worker thread, so the event loop keeps serving the environment I/O of
other rollouts while the accelerator decodes. Requests that arrive during a step join at the next
one (continuous batching across rollouts). Failures follow the driver's one policy: a refused
request raises ValueError; a failed step fails the requests in it (RuntimeError) and the driver
rebuilds the sampler (`Sampler.rebuilt`, with the weights before a swap whose first step failed),
so later requests are served.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from collections.abc import Sequence
from typing import Any

from composer_jax.inference.engine.batch_sampler import Completion, Request, Sampler
from composer_jax.inference.engine.driver import Driver, Event, Job, Swap
from composer_jax.inference.engine.token_sampling import SamplingParams


class AsyncSampler:
    """Await completions from `sampler` from many coroutines of one event loop."""

    def __init__(self, sampler: Sampler):
        first = [sampler]
        # the given sampler first; after a failed step, one built with its settings
        new = lambda params, version: first.pop() if first else sampler.rebuilt(params, version)
        self.driver = Driver(new, sampler.params, sampler.version)
        self._inbox: list[Job] = []
        self._swap: Swap | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task | None = None

    @property
    def sampler(self) -> Sampler:
        return self.driver.sampler

    @property
    def steps(self) -> int:
        return self.driver.steps

    @property
    def version(self) -> int:
        """The policy version of the weights the next decode step uses."""
        return self._swap.version if self._swap is not None else self.sampler.version

    async def generate(self, prompt: Sequence[int], params: SamplingParams, request_id: str = "") -> Completion:
        """One completion of `prompt`; raises ValueError for a request the sampler refuses (too long,
        token ids outside the vocabulary) and RuntimeError if the decode step it was in failed."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Completion] = loop.create_future()

        def listener(event: Event) -> None:  # called in the driver's worker thread
            loop.call_soon_threadsafe(_resolve, future, event)

        self._inbox.append(Job(Request(list(map(int, prompt)), params, request_id), listener, stream=False))
        self._kick()
        return await future

    def update_weights(self, params: Any, version: int) -> None:
        """New weights from the next decode step on (running requests continue, as
        `Sampler.update_weights`); a later call before that step replaces an earlier one."""
        self._swap = Swap(params, version, concurrent.futures.Future())
        self._kick()

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None

    # ------------------------------------------------------------------------------ driver
    def _kick(self) -> None:
        if self._wake is None:
            self._wake = asyncio.Event()
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._drive(), name="sampler-driver")

    async def _drive(self) -> None:
        assert self._wake is not None
        try:
            while True:
                inbox, self._inbox = self._inbox, []
                swaps = [self._swap] if self._swap is not None else []
                self._swap = None
                if not (inbox or swaps or self.driver.busy):
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                await asyncio.to_thread(self.driver.cycle, inbox, (), swaps)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a bug outside the sampler's step: every waiting request learns why
            self.driver.fail_all(f"the sampler's driver failed: {exc!r}", 500)
            for job in self._inbox:
                job.listener(Event(job.request.id, error=f"the sampler's driver failed: {exc!r}", status=500))
            self._inbox.clear()
            raise


def _resolve(future: asyncio.Future, event: Event) -> None:
    if future.done():  # its awaiting coroutine may have been cancelled
        return
    if event.completion is not None:
        future.set_result(event.completion)
    elif event.error is not None:
        future.set_exception(ValueError(event.error) if event.status == 400 else RuntimeError(event.error))
