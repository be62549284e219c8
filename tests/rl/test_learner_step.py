"""One learner step with an in-process stand-in for the rollout side: no child process, no server.

The stand-in hands the learner fixed groups (tests/support/rl_groups.py's `make_group`) and
records what the learner tells it; the step must build their batch, train the tiny model on it
(the weights move), hand version 1 to the samplers with the count of groups trained, and record
the trained ids in the ledger, the checkpoint's done ids and the summary."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import jax
import numpy as np
from support.live_env import REPO
from support.rl_groups import make_group

from composer_jax.config import load_config
from composer_jax.rl.learner import Learner
from composer_jax.rl.rollout.group_store import Group


class StandInRollouts:
    """The `Rollouts` interface over groups given up front."""

    def __init__(self, groups: list[Group]):
        self.groups = list(groups)
        self.next_index = max(g.index for g in groups) + 1
        self.handed: list[tuple[int, int]] = []  # (version, groups trained)
        self.queue_started = self.closed = False
        self.scrapes = 0

    def start_queue(self) -> None:
        self.queue_started = True

    async def stop_queue(self) -> None:
        pass

    async def take(self, step, fits):
        taken: list[Group] = []
        for g in list(self.groups):
            if fits(taken, g):
                taken.append(g)
                self.groups.remove(g)
        return taken, []

    def finished_untrained(self) -> dict[str, list[int]]:
        return {"dropped_stale_groups": [], "lost_groups": []}

    def queue_values(self) -> dict[str, float]:
        return {"queue/ready": float(len(self.groups)), "queue/in_flight": 0.0}

    async def hand_over(self, params: Any, version: int, trained: int) -> None:
        self.handed.append((version, trained))

    async def sample_tasks(self, tasks, samples, seed):
        raise AssertionError("no evaluation in this run")

    async def health(self) -> list[dict]:
        return []

    async def profile_counters(self) -> dict[str, dict[str, float]]:
        """A replica whose engine ran 2 s (0.5 s of them prefill) between two readings."""
        self.scrapes += 1
        return {"sampler stand-in": {"sampler_step_s": 2.0 * self.scrapes, "sampler_prefill_s": 0.5 * self.scrapes}}

    async def aclose(self) -> None:
        self.closed = True


def child_pids() -> set[int]:
    out: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        try:
            out |= {int(p) for p in (task / "children").read_text().split()}
        except FileNotFoundError:  # a thread that ended since the listing (none of its children remain)
            continue
    return out


def test_one_learner_step_against_an_in_process_rollout_side(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(REPO)
    overrides = [f"train.out_dir={tmp_path}", "train.steps=1", "rl.eval_tasks=[]", "checkpoint.save_every=1"]
    cfg = load_config("tests/rl/fixtures/rl_pick.yaml", overrides)
    before = child_pids()
    learner = Learner(cfg, echo=lambda _line: None)
    start = jax.device_get(learner.state.params)
    # two groups of 4 rollouts (rewards 0, 1, 0, 1: a non-zero advantage), tokens of version 0
    groups = [make_group(0, [[0] * 6] * 4), make_group(1, [[0] * 5] * 4)]
    layers, k, experts = cfg.model.num_moe_layers, cfg.model.num_experts_per_tok, cfg.model.num_experts
    for g in groups:  # the experts the sampler would have recorded (router replay is on)
        for r in g.rollouts:
            n = len(r.generations[0].tokens)
            r.generations[0].routing = (np.arange(n * layers * k, dtype=np.int32) % experts).reshape(n, layers, k)
    side = StandInRollouts(groups)
    learner.attach(side)

    asyncio.run(learner.profile.start())  # (the run's before_steps takes it)
    values = asyncio.run(learner.step(0))
    # where the step's time went (runtime/profile.py): the stand-in's counters, the cores, the update
    assert values["profile/sampler_decode_s"] == 1.5 and values["profile/sampler_prefill_s"] == 0.5
    assert values["profile/wall_s"] >= values["time/step_s"] >= values["time/update_s"] > 0
    busy = [k for k in values if k.startswith("profile/core") and k.endswith("_busy")]
    assert len(busy) == len(os.sched_getaffinity(0)) and all(0.0 <= values[k] <= 1.0 for k in busy)
    assert side.handed == [(1, 2)]
    assert values["rollout/groups"] == 2.0 and values["staleness/max"] == 0.0
    assert values["policy_tokens"] == 4 * 6 + 4 * 5
    assert learner.ledger.trained == {1: [0, 1]} and 0 in learner.ledger.done and 1 in learner.ledger.done
    moved = jax.tree.map(
        lambda a, b: bool(np.any(np.asarray(a) != np.asarray(b))), start, jax.device_get(learner.state.params)
    )
    assert any(jax.tree.leaves(moved)), "the step left every weight unchanged"

    learner.checkpoint(1, force=True)
    summary = learner.close()
    assert summary["trained_groups"] == {1: [0, 1]} and summary["lost_groups"] == []
    assert learner.checkpointer.all_steps() == [1]
    assert child_pids() == before, "the learner step started a child process"
    assert not os.path.exists(tmp_path / "samplers")
