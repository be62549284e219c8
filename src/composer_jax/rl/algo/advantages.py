"""Group-relative advantage estimators, in a registry (`rl.loss.advantage` names one).

Each rollout of a group (G samples of one task) gets one advantage, applied to every policy token
of the rollout (all generations of a self-summarisation chain). Estimators take the rollouts'
rewards and group ids and return the advantages; host-side numpy, run when the batch is built.

- `drgrpo` (Dr. GRPO, Liu et al. 2025; Composer 2): A_i = r_i - mean_{j in group(i)} r_j. No
  division by the group's standard deviation, which would weight nearly-solved and nearly-failed
  tasks (small std) above the informative ones.
- `grpo` (DeepSeekMath, Shao et al. 2024): A_i = (r_i - mean) / (std + 1e-6), the sample standard
  deviation of the group (n - 1 in the denominator, as TRL and torch.std); 0 for a group of one.

On-policy distillation (`rl.loss.objective: distill`) makes the advantage per token:
`distill_advantages` mixes the rollout's advantage with the teacher's log ratio of each token.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import numpy as np

AdvantageEstimator = Callable[[np.ndarray, Sequence[Hashable]], np.ndarray]
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}
GRPO_STD_EPS = 1e-6


def register_advantage_estimator(name: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator: register `fn(rewards float[n], groups [n]) -> advantages float[n]` as `name`."""

    def register(fn: AdvantageEstimator) -> AdvantageEstimator:
        if name in ADVANTAGE_ESTIMATORS:
            raise ValueError(f"advantage estimator {name!r} is already registered")
        ADVANTAGE_ESTIMATORS[name] = fn
        return fn

    return register


def _group_index(groups: Sequence[Hashable], n: int) -> tuple[np.ndarray, int]:
    if len(groups) != n:
        raise ValueError(f"{n} rewards but {len(groups)} group ids; give one group id per rollout")
    ids: dict[Hashable, int] = {}
    index = np.asarray([ids.setdefault(g, len(ids)) for g in groups], np.int64)
    return index, len(ids)


def group_means(rewards: np.ndarray, groups: Sequence[Hashable]) -> np.ndarray:
    """Each rollout's group mean reward. rewards: float[n]; groups: [n] hashable ids -> float64[n]."""
    r = np.asarray(rewards, np.float64)
    index, g = _group_index(groups, r.shape[0])
    sums = np.bincount(index, weights=r, minlength=g)
    counts = np.bincount(index, minlength=g)
    return (sums / counts)[index]


@register_advantage_estimator("drgrpo")
def drgrpo_advantages(rewards: np.ndarray, groups: Sequence[Hashable]) -> np.ndarray:
    """A_i = r_i - mean of r over i's group (Dr. GRPO). float[n] -> float64[n]."""
    r = np.asarray(rewards, np.float64)
    return r - group_means(r, groups)


@register_advantage_estimator("grpo")
def grpo_advantages(rewards: np.ndarray, groups: Sequence[Hashable]) -> np.ndarray:
    """A_i = (r_i - mean) / (sample std of the group + 1e-6) (GRPO). float[n] -> float64[n]."""
    r = np.asarray(rewards, np.float64)
    index, g = _group_index(groups, r.shape[0])
    centred = r - group_means(r, groups)
    counts = np.bincount(index, minlength=g)
    var = np.bincount(index, weights=centred**2, minlength=g) / np.maximum(counts - 1, 1)
    return centred / (np.sqrt(var)[index] + GRPO_STD_EPS)


def advantages(name: str, rewards: np.ndarray, groups: Sequence[Hashable]) -> np.ndarray:
    """The registered estimator `name` applied to per-rollout rewards and group ids."""
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"advantage estimator {name!r} is not registered; registered: {sorted(ADVANTAGE_ESTIMATORS)}")
    r = np.asarray(rewards, np.float64)
    if r.ndim != 1 or not np.all(np.isfinite(r)):
        raise ValueError(f"rewards must be a finite 1-D array (one per rollout), got {r!r}")
    return ADVANTAGE_ESTIMATORS[name](r, groups)


def distill_advantages(
    task_advantage: float,
    teacher_logprobs: np.ndarray,
    student_logprobs: np.ndarray,
    loss_mask: np.ndarray,
    *,
    weight: float,
    task_weight: float,
) -> np.ndarray:
    """On-policy distillation's per-token advantage of one generation:

        A_t = task_weight * A_task + weight * (log teacher(t) - log student(t))   on policy tokens

    and task_weight * A_task elsewhere (no loss reaches them). log teacher - log student is the
    negative of the per-token reverse KL estimate k1 of KL(student || teacher) on the student's own
    sample: a token the teacher finds likelier than the student did is pushed up. student = the
    sampler's recorded log-probability (the distribution the token was drawn from). Arrays [n] ->
    float64[n]."""
    teacher = np.asarray(teacher_logprobs, np.float64)
    student = np.asarray(student_logprobs, np.float64)
    on = np.asarray(loss_mask) > 0
    if teacher.shape != student.shape or teacher.shape != on.shape:
        raise ValueError(
            f"teacher {teacher.shape}, student {student.shape} and mask {on.shape}: give one log-probability per token"
        )
    reverse_kl = np.where(on, teacher - student, 0.0)
    if not np.all(np.isfinite(reverse_kl)):
        raise ValueError("a policy token has a non-finite teacher or student log-probability")
    return task_weight * float(task_advantage) + weight * reverse_kl
