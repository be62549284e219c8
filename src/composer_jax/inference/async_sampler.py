"""asyncio front end for one Sampler: many coroutines await completions; one driver steps.

Rollout workers are coroutines: each awaits a completion, then its environment's tool calls, then
the next completion. `AsyncSampler.generate` queues a request and awaits it; a single driver task
owns the Sampler: between two decode steps it applies a pending weight update and submits the
queued requests, then runs `Sampler.step` in a worker thread, so the event loop keeps serving the
environment I/O of other rollouts while the accelerator decodes. Requests that arrive during a step
join at the next one (continuous batching across rollouts).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from composer_jax.inference.sampler import Completion, Request, Sampler
from composer_jax.inference.sampling import SamplingParams


class AsyncSampler:
    """Await completions from `sampler` from many coroutines of one event loop."""

    def __init__(self, sampler: Sampler):
        self.sampler = sampler
        self._pending: list[tuple[Request, asyncio.Future]] = []
        self._running: dict[str, asyncio.Future] = {}
        self._weights: tuple[Any, int] | None = None
        self._wake: asyncio.Event | None = None
        self._driver: asyncio.Task | None = None
        self._failed: BaseException | None = None
        self.steps = 0

    @property
    def version(self) -> int:
        """The policy version of the weights the next decode step uses."""
        return self._weights[1] if self._weights is not None else self.sampler.version

    async def generate(self, prompt: Sequence[int], params: SamplingParams, request_id: str = "") -> Completion:
        """One completion of `prompt`; raises ValueError for a request the sampler refuses (too long,
        token ids outside the vocabulary) and the driver's error if a decode step failed."""
        if self._failed is not None:
            raise RuntimeError(f"the sampler failed earlier: {self._failed!r}") from self._failed
        future = asyncio.get_running_loop().create_future()
        self._pending.append((Request(list(map(int, prompt)), params, request_id), future))
        self._kick()
        return await future

    def update_weights(self, params: Any, version: int) -> None:
        """New weights from the next decode step on (running requests continue, as
        `Sampler.update_weights`); a later call before that step replaces an earlier one."""
        self._weights = (params, version)
        self._kick()

    async def aclose(self) -> None:
        if self._driver is not None:
            self._driver.cancel()
            try:
                await self._driver
            except asyncio.CancelledError:
                pass
            self._driver = None

    # ------------------------------------------------------------------------------ driver
    def _kick(self) -> None:
        if self._wake is None:
            self._wake = asyncio.Event()
        self._wake.set()
        if self._driver is None or self._driver.done():
            self._driver = asyncio.get_running_loop().create_task(self._drive(), name="sampler-driver")

    def _admit(self) -> None:
        if self._weights is not None:
            self.sampler.update_weights(*self._weights)
            self._weights = None
        pending, self._pending = self._pending, []
        for request, future in pending:
            try:
                rid = self.sampler.submit(request)
            except ValueError as exc:
                future.set_exception(exc)
                continue
            self._running[rid] = future

    async def _drive(self) -> None:
        assert self._wake is not None
        try:
            while True:
                self._admit()
                if not self.sampler.busy:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                done = await asyncio.to_thread(self.sampler.step)
                self.steps += 1
                for completion in done:
                    future = self._running.pop(completion.id)
                    if not future.done():  # its awaiting coroutine may have been cancelled
                        future.set_result(completion)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # a failed step: every waiting request learns why
            self._failed = exc
            for future in [*self._running.values(), *(f for _, f in self._pending)]:
                if not future.done():
                    future.set_exception(RuntimeError(f"sampler step failed: {exc!r}"))
            self._running.clear()
            self._pending.clear()
            raise
