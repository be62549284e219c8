"""Finished groups on disk: one file per group, written atomically as it completes.

A group (`Group`: the rollouts of one task sampled together) is the learner's unit of data. The
learner persists every finished group under the run directory (`RUN/rollouts/group_00000042.npz`)
before it is queued for training, so a trainer that dies loses none of them: a restarted run trains
the persisted groups its checkpoint has not covered and re-samples only the groups that were still
in flight. A file holds every array the batch needs (per generation: tokens, loss mask, sampler
log-probabilities, policy versions, routed experts) and, as JSON, the group id, its task, the
policy version it started at, each rollout's counts and grade, its composed reward and its OpenAI
messages. It is written to a temporary name and renamed, so a reader sees a whole file or none.
Files of groups a checkpoint covers (trained or dropped) are deleted after that checkpoint.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
from pathlib import Path

import numpy as np

from composer_jax.rl.algo.rewards import RewardBreakdown
from composer_jax.rl.rollout.agent import Rollout
from composer_jax.rl.rollout.tasks import TaskRef
from composer_jax.rl.samplers.policy import Generation

_NAME = re.compile(r"^group_(\d{8,})\.npz$")
FORMAT = 1


@dataclasses.dataclass
class Group:
    """Rollouts of one task sampled together (their rewards' mean is the advantage baseline)."""

    index: int  # position in the run's task stream (the group id)
    task: TaskRef
    rollouts: list[Rollout]
    rewards: list[RewardBreakdown]
    failed: int = 0  # rollouts whose environment failed on every attempt (not scored)
    version: int = 0  # the sampler's policy version when the group started

    @property
    def rows(self) -> int:
        return sum(len(r.generations) for r in self.rollouts)

    def policy_token_versions(self) -> np.ndarray:
        """The policy versions of every policy token (loss mask > 0) of the group's generations."""
        parts = [
            np.asarray(g.versions)[np.asarray(g.loss_mask) > 0]
            for r in self.rollouts
            for g in r.generations
            if g.versions
        ]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros((0,), np.int64)

    def oldest_token_version(self) -> int:
        """The policy version of the group's oldest policy token (`version` when it has none)."""
        versions = self.policy_token_versions()
        return int(versions.min()) if versions.size else self.version

    def newest_token_version(self) -> int:
        """The policy version of the group's newest policy token, or `version` when that is newer."""
        versions = self.policy_token_versions()
        return max(self.version, int(versions.max())) if versions.size else self.version


class RolloutStoreError(ValueError):
    """A persisted group file that cannot be read back (truncated, foreign, or of another format)."""


class GroupStore:
    """The persisted groups of one run: `save` as groups finish, `load` on resume, `remove` once a
    checkpoint covers them."""

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)

    def path(self, index: int) -> Path:
        return self.dir / f"group_{index:08d}.npz"

    def indices(self) -> list[int]:
        """Group ids with a file, ascending."""
        return sorted(int(m.group(1)) for p in self.dir.iterdir() if (m := _NAME.match(p.name)))

    def save(self, group: Group) -> Path:
        """Write `group` to its file atomically (temporary file, fsync, rename)."""
        arrays: dict[str, np.ndarray] = {}
        rollouts = []
        for i, r in enumerate(group.rollouts):
            gens = []
            for j, g in enumerate(r.generations):
                key = f"r{i}_g{j}_"
                arrays[key + "tokens"] = np.asarray(g.tokens, np.int32)
                arrays[key + "loss_mask"] = np.asarray(g.loss_mask, np.float32)
                arrays[key + "logprobs"] = np.asarray(g.logprobs, np.float32)
                arrays[key + "versions"] = np.asarray(g.versions, np.int64)
                if g.routing is not None:
                    arrays[key + "routing"] = np.asarray(g.routing, np.int32)
                gens.append({"messages": g.messages, "generated": g.generated})
            fields = {f.name: getattr(r, f.name) for f in dataclasses.fields(r) if f.name != "generations"}
            rollouts.append({**fields, "generations": gens})
        meta = {
            "format": FORMAT,
            "index": group.index,
            "task": {"task_id": group.task.task_id, "env_seed": group.task.env_seed, "category": group.task.category},
            "failed": group.failed,
            "version": group.version,
            "rollouts": rollouts,
            "rewards": [b.as_dict() for b in group.rewards],
        }
        arrays["meta"] = np.frombuffer(json.dumps(meta).encode(), np.uint8)
        buf = io.BytesIO()
        np.savez(buf, **arrays)  # type: ignore[arg-type]
        final = self.path(group.index)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        with open(tmp, "wb") as f:
            f.write(buf.getvalue())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        return final

    def load(self, index: int) -> Group:
        """The group saved as `index`; RolloutStoreError when its file is unreadable."""
        path = self.path(index)
        try:
            with np.load(path, allow_pickle=False) as z:
                arrays = {k: z[k] for k in z.files}
            meta = json.loads(arrays.pop("meta").tobytes().decode())
        except (OSError, ValueError, KeyError) as exc:
            raise RolloutStoreError(f"{path}: not a readable persisted group ({exc})") from exc
        if meta.get("format") != FORMAT or meta.get("index") != index:
            raise RolloutStoreError(
                f"{path}: format {meta.get('format')!r}, group {meta.get('index')!r}; expected format {FORMAT}, "
                f"group {index}"
            )
        rollouts = []
        for i, rm in enumerate(meta["rollouts"]):
            gens = []
            for j, gm in enumerate(rm.pop("generations")):
                key = f"r{i}_g{j}_"
                routing = arrays.get(key + "routing")
                gens.append(
                    Generation(
                        gm["messages"],
                        arrays[key + "tokens"].tolist(),
                        arrays[key + "loss_mask"].tolist(),
                        arrays[key + "logprobs"].tolist(),
                        arrays[key + "versions"].tolist(),
                        routing,
                        gm["generated"],
                    )
                )
            rollouts.append(Rollout(generations=gens, **rm))
        return Group(
            index,
            TaskRef(**meta["task"]),
            rollouts,
            [RewardBreakdown.from_dict(b) for b in meta["rewards"]],
            meta["failed"],
            meta["version"],
        )

    def remove(self, indices: set[int] | list[int]) -> None:
        for i in indices:
            self.path(i).unlink(missing_ok=True)
