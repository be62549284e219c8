"""The learner's ledger of group ids: which are done (trained, dropped as stale, or lost), and when
a done group's persisted file may go.

A group id is used once along a run's checkpointed lineage. The ids done are part of every
checkpoint (`DoneIds` in the data state); a group's file (`rl/rollout/group_store.py`) is removed only
once a committed checkpoint records its id as done, so a trainer killed between two checkpoints
finds on disk every group the lost steps trained and trains it again on resume.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from composer_jax.rl.rollout.group_store import Group, GroupStore, RolloutStoreError
from composer_jax.rl.rollout.queue import DoneIds

# the summary keys of the ids finished without training, in the order they are reported
UNTRAINED = ("dropped_stale_groups", "lost_groups")


@dataclasses.dataclass(frozen=True)
class ResumePoint:
    """Where a run's rollout queue starts: the persisted groups to train first (`ready`), the ids
    to sample again (`again`: in flight when the last run stopped), one past the highest id used
    (`end`: the stream goes on from there), the policy version (the checkpoint's step) and the most
    groups the remaining steps train (`budget`)."""

    ready: tuple[Group, ...]
    again: tuple[int, ...]
    end: int
    version: int
    budget: int


@dataclasses.dataclass(frozen=True)
class GroupsState:
    """The group part of a checkpoint's data state: the next group id of the task stream and the
    ids done. `data_state()` is what is saved (`{"next_group": N, "done": {"below": B, "extra":
    [...]}}`); `from_data_state` reads it back."""

    next_group: int
    done: DoneIds

    def data_state(self) -> dict[str, Any]:
        return {"next_group": int(self.next_group), "done": self.done.state()}

    @classmethod
    def from_data_state(cls, data_state: dict[str, Any] | None) -> GroupsState:
        d = data_state or {}
        next_group = int(d.get("next_group", 0))
        # runs saved before the queue: every group below next_group was trained
        return cls(next_group, DoneIds.from_state(d["done"]) if "done" in d else DoneIds(next_group))


def resume_groups(
    store: GroupStore, done: DoneIds, next_group: int, version: int, echo: Callable[[str], None]
) -> tuple[list[Group], list[int], int]:
    """The persisted groups not done yet (loaded), the ids that were in flight (re-sampled), and
    one past the highest id used. Files of done groups are removed, and so are those of groups with
    tokens of a policy version after `version` (the checkpoint resumed from): a trainer stopped after
    its last checkpoint published versions that died with it, and those groups are sampled again."""
    ready: list[Group] = []
    on_disk = store.indices()
    store.remove([i for i in on_disk if i in done])
    for i in on_disk:
        if i in done:
            continue
        try:
            g = store.load(i)
        except RolloutStoreError as exc:
            echo(f"[rl] {exc}; group {i} is sampled again")
            continue
        if g.newest_token_version() > version:
            newest = g.newest_token_version()
            echo(f"[rl] group {i}: a token of version {newest}, lost with the stopped run; sampled again")
            store.remove([i])
            continue
        ready.append(g)
    end = max([next_group, *(i + 1 for i in on_disk)])
    have = {g.index for g in ready}
    again = [i for i in range(done.below, end) if i not in done and i not in have]
    return ready, again, end


class GroupLedger:
    """The ids done (every process keeps the same ledger: it goes into each checkpoint), the ids
    trained per step and those finished untrained (for the run's summary), and the done ids whose
    files wait for a checkpoint that covers them (process 0 removes those files)."""

    def __init__(self, done: DoneIds):
        self.done = done
        self.trained: dict[int, list[int]] = {}  # step -> ids trained by it
        self.untrained: dict[str, list[int]] = {key: [] for key in UNTRAINED}
        self._uncovered: list[int] = []  # done since the last checkpoint save
        self._covered: list[tuple[int, list[int]]] = []  # (saved step, ids its commit makes removable)

    def finish_untrained(self, finished: dict[str, list[int]]) -> list[int]:
        """Record ids finished without training (`finished`: summary key -> ids, as the rollout side
        reports them) as done; returns them."""
        out = []
        for key, ids in finished.items():
            for i in ids:
                self.done.add(i)
                self.untrained[key].append(i)
                out.append(i)
        self._uncovered += out
        return out

    def finish_trained(self, step: int, ids: list[int]) -> None:
        """Record the ids step `step` trained as done."""
        for i in ids:
            self.done.add(i)
        self._uncovered += ids
        self.trained[step] = list(ids)

    def untrained_so_far(self, since: dict[str, list[int]]) -> dict[str, list[int]]:
        """The untrained ids recorded plus those in `since` (not recorded yet), by summary key."""
        return {key: self.untrained[key] + list(since.get(key, [])) for key in UNTRAINED}

    def saved(self, step: int) -> None:
        """A checkpoint of `step` was started: once it commits, the ids done so far may lose their files."""
        self._covered.append((step, self._uncovered))
        self._uncovered = []

    def removable(self) -> list[int]:
        """The ids whose files every started checkpoint save covers (call once those have committed);
        they are forgotten here."""
        out = [i for _, ids in self._covered for i in ids]
        self._covered = []
        return out

    def has_removable(self) -> bool:
        return bool(self._covered)
