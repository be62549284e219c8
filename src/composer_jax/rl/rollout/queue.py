"""The rollout queue: groups sampled continuously, trained as they arrive, never too stale.

Rollout workers (one asyncio task per group, its rollouts concurrent inside it) keep sampling the
run's task stream while the trainer steps; each finished group is persisted (`rollout_store`) and
put in the queue; the trainer takes whole groups for each step. Policy versions: the weights the
trainer is about to train at step k are version k; after the step the samplers get version k + 1.

Staleness of a group trained at version k: k minus the version of its oldest policy token
(`rl.staleness_unit: token`) or k minus the version it started at (`group`). A group staler than
`rl.max_staleness` (s) is dropped whole and counted. The scheduler avoids producing such groups:

- credit: a group may start only while the groups started and not yet trained or lost number
  fewer than (s + 1) x groups_per_step: the next s + 1 steps can train all of them. Each step
  returns the credit of the groups it trained; a lost group (dropped, or too few scored rollouts)
  returns its own at once. With s = 0 the producer starts one step's groups and waits for the
  update: exactly the synchronous learner.
- the trainer at version k first waits for every in-flight group that started at a version
  <= k - s (its last chance to be fresh enough) and takes the finished groups oldest first.

Samplers are a list of policies (`rl/samplers/policy.py`'s `PolicyPool`): rollouts are spread over them in turn; a
policy that raises `SamplerUnavailable` is taken out of rotation and the rollout is redone on another.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any

from composer_jax.rl.rollout.group_store import Group

log = logging.getLogger(__name__)
__all__ = ["DoneIds", "RolloutQueue", "staleness"]


def staleness(group: Group, version: int, unit: str) -> int:
    """How many policy versions `group` is behind `version` (the version being trained)."""
    return version - (group.version if unit == "group" else group.oldest_token_version())


class DoneIds:
    """The group ids the learner is finished with (trained or dropped), compactly: every id below
    `below`, plus the ids in `extra` (those finished out of order)."""

    def __init__(self, below: int = 0, extra: Iterable[int] = ()):
        self.below = below
        self.extra: set[int] = set()
        for i in extra:
            self.add(i)

    def __contains__(self, index: int) -> bool:
        return index < self.below or index in self.extra

    def add(self, index: int) -> None:
        if index in self:
            raise ValueError(f"group {index} is already done (trained or dropped); a group id is used once")
        self.extra.add(index)
        while self.below in self.extra:
            self.extra.remove(self.below)
            self.below += 1

    def state(self) -> dict[str, Any]:
        return {"below": self.below, "extra": sorted(self.extra)}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> DoneIds:
        below, extra = state.get("below"), state.get("extra", [])
        if not isinstance(below, int) or below < 0 or not all(isinstance(i, int) and i >= below for i in extra):
            raise ValueError(f"done-groups state {state!r}: expected {{'below': int >= 0, 'extra': [ids >= below]}}")
        return cls(below, extra)


class RolloutQueue:
    """Schedules group sampling ahead of the trainer within the staleness bound (module docstring).

    sample(index, version): a coroutine sampling group `index` (its task and seeds are a function
    of the index) started at policy `version`; persist(group): called as each group finishes,
    before it is queued. order: the group ids to sample, in order (re-sampled ids first, then the
    stream); `ready`: finished groups to train first (persisted by an earlier run). `budget`: the
    most groups this run will train (no group is started beyond what the remaining steps need).
    """

    def __init__(
        self,
        *,
        sample: Callable[[int, int], Awaitable[Group]],
        persist: Callable[[Group], Awaitable[None]],
        order: Iterable[int],
        ready: Sequence[Group] = (),
        version: int,
        groups_per_step: int,
        max_staleness: int,
        unit: str,
        max_in_flight: int = 0,
        queue_size: int = 0,
        budget: int,
    ):
        self._sample, self._persist, self._order = sample, persist, iter(order)
        self.ready: list[Group] = list(ready)
        self.version = version
        self.gps, self.s, self.unit = groups_per_step, max_staleness, unit
        self.max_in_flight = max_in_flight or groups_per_step * (max_staleness + 1)
        self.queue_size = queue_size
        self.credit = groups_per_step * (max_staleness + 1) - len(self.ready)
        self.budget = budget - len(self.ready)  # groups still to start
        self.in_flight: dict[int, tuple[int, asyncio.Task]] = {}  # index -> (start version, task)
        self.next_index = 0  # one past the highest id started or loaded (for the checkpoint)
        for g in self.ready:
            self.next_index = max(self.next_index, g.index + 1)
        self.started = 0
        self.lost: list[int] = []  # finished with fewer than 2 scored rollouts
        self.dropped_stale: list[int] = []
        self._changed = asyncio.Event()
        self._error: BaseException | None = None
        self._scheduler: asyncio.Task | None = None

    # -- producer -------------------------------------------------------------------------------
    def start(self) -> None:
        self._scheduler = asyncio.get_running_loop().create_task(self._schedule(), name="rollout-scheduler")

    async def _schedule(self) -> None:
        while True:
            while (
                self.credit > 0
                and self.budget > 0
                and len(self.in_flight) < self.max_in_flight
                and (not self.queue_size or len(self.ready) < self.queue_size)
            ):
                index = next(self._order)
                self.credit -= 1
                self.budget -= 1
                self.started += 1
                self.next_index = max(self.next_index, index + 1)
                task = asyncio.get_running_loop().create_task(self._run_group(index, self.version))
                self.in_flight[index] = (self.version, task)
            self._changed.clear()
            await self._changed.wait()

    async def _run_group(self, index: int, version: int) -> None:
        try:
            group = await self._sample(index, version)
            group.version = version
            if len(group.rollouts) >= 2:
                await self._persist(group)
                self.ready.append(group)
            else:  # fewer than 2 scored rollouts have no advantage: lost, its credit returned
                log.warning("group %d: %d scored rollout(s); not trained", index, len(group.rollouts))
                self.lost.append(index)
                self.credit += 1
                self.budget += 1
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # the trainer learns of it in `take`
            self._error = exc
        finally:
            self.in_flight.pop(index, None)
            self._changed.set()

    def advance(self, version: int, trained: int) -> None:
        """The samplers have `version` now; the step before it trained `trained` groups."""
        self.version = version
        self.credit += trained
        self._changed.set()

    # -- consumer -------------------------------------------------------------------------------
    def _blocking(self, version: int) -> bool:
        """An in-flight group must finish before training `version` (its last fresh-enough version)."""
        return any(v <= version - self.s for v, _ in self.in_flight.values())

    async def take(self, version: int, fits: Callable[[list[Group], Group], bool]) -> tuple[list[Group], list[Group]]:
        """The groups to train at `version`: waits for groups_per_step fresh-enough groups (or
        nothing left to wait for) and for the in-flight groups about to go stale, then takes the
        finished ones oldest first while `fits(taken, group)`. Returns (taken, dropped as stale)."""
        dropped: list[Group] = []
        while True:
            if self._error is not None:
                raise self._error
            for g in list(self.ready):
                if staleness(g, version, self.unit) > self.s:
                    self.ready.remove(g)
                    dropped.append(g)
                    self.dropped_stale.append(g.index)
                    self.credit += 1
                    self.budget += 1
            if dropped:
                self._changed.set()
            enough = len(self.ready) >= self.gps or (not self.in_flight and (self.budget <= 0 or self.credit <= 0))
            if enough and not self._blocking(version):
                break
            self._changed.clear()
            await self._changed.wait()
        self.ready.sort(key=lambda g: (g.version, g.index))
        taken: list[Group] = []
        for g in list(self.ready):
            if len(taken) == self.gps or not fits(taken, g):
                break
            taken.append(g)
            self.ready.remove(g)
        self._changed.set()  # room in the queue
        return taken, dropped

    async def aclose(self) -> None:
        tasks = [t for _, t in self.in_flight.values()]
        if self._scheduler is not None:
            tasks.append(self._scheduler)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.in_flight.clear()
