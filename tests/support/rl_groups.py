"""Scored rollout groups made without a model, for the rollout-queue and learner tests: every token
stamped with the policy version that generated it."""

from __future__ import annotations

import numpy as np

from composer_jax.rl.algo.rewards import RewardBreakdown
from composer_jax.rl.rollout.agent import Rollout
from composer_jax.rl.rollout.group_store import Group
from composer_jax.rl.rollout.tasks import TaskRef
from composer_jax.rl.samplers.policy import Generation


def make_group(index: int, versions: list[list[int]], routing: bool = False) -> Group:
    """A group whose rollout i generated tokens with policy versions versions[i] after a 3-token prompt."""
    rollouts, rewards = [], []
    for i, vs in enumerate(versions):
        n = 3 + len(vs)
        gen = Generation(
            [{"role": "user", "content": f"task {index}"}],
            tokens=list(range(10, 10 + n)),
            loss_mask=[0.0] * 3 + [1.0] * len(vs),
            logprobs=[0.0] * 3 + [-0.5 - 0.1 * j for j in range(len(vs))],
            versions=[-1] * 3 + list(vs),
            routing=np.arange(n * 2 * 2, dtype=np.int32).reshape(n, 2, 2) % 8 if routing else None,
            generated=len(vs),
        )
        rollouts.append(Rollout("t", 100 * index + i, [gen], "answer", {"reward": float(i % 2)}, turns=1))
        rewards.append(RewardBreakdown(float(i % 2), float(i % 2), 0.0, 0.0, 0.0, 0.0))
    return Group(index, TaskRef("t"), rollouts, rewards, version=min(min(v) for v in versions))
