"""Completed rollouts -> the padded numpy batch the RL objective (`rl/algo/loss.py`) consumes.

A rollout (`ScoredRollout`) is one or more generations (a self-summarisation chain: each generation is the model's
context from the task, or the task plus a summary, to its last token); each generation becomes
one row of the batch, and every row of a rollout carries the rollout's advantage, so the final
reward reaches every generation's tokens, the summaries included. Advantages are computed over
rollouts (a chain of three generations counts once in its group's mean).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Sequence
from typing import Protocol

import numpy as np

from composer_jax.config import Config
from composer_jax.rl.algo.advantages import advantages as estimate_advantages
from composer_jax.rl.algo.advantages import distill_advantages
from composer_jax.rl.algo.loss import replays_routing


class TokenGeneration(Protocol):
    """One model context, token by token (all of length n): what `build_batch` reads of a
    generation. The agent loop's `rl.policy.Generation` is one; `GenerationRecord` another.

    tokens: int[n], the prompt, the policy's tokens and the tool observations in order;
    loss_mask: 0/1 [n], 1 on tokens the policy generated (trained), 0 on prompt and observation
    tokens; logprobs: float[n], the sampler's log-probability of each policy token (ignored where
    loss_mask is 0); versions: int[n] or None, the policy version that generated each policy token;
    routing: int32[m, moe_layers, k] or None, the sampler's experts of tokens 0..m-1 (m = n or
    n - 1: `inference.engine.slot_table.Completion.routing` misses the last token, which no forward pass
    has seen; its replayed experts affect only its own, untrained, output). A policy token at
    index 0 is never trained (no position predicts it)."""

    @property
    def tokens(self) -> Sequence[int] | np.ndarray: ...

    @property
    def loss_mask(self) -> Sequence[float] | np.ndarray: ...

    @property
    def logprobs(self) -> Sequence[float] | np.ndarray: ...

    @property
    def versions(self) -> Sequence[int] | np.ndarray | None: ...

    @property
    def routing(self) -> np.ndarray | None: ...


@dataclasses.dataclass
class GenerationRecord:
    """A `TokenGeneration` as plain data (fields as described there)."""

    tokens: Sequence[int] | np.ndarray
    loss_mask: Sequence[float] | np.ndarray
    logprobs: Sequence[float] | np.ndarray
    versions: Sequence[int] | np.ndarray | None = None
    routing: np.ndarray | None = None
    # on-policy distillation: the teacher's log-probability of each token (index 0: 0.0, nothing
    # predicts it), attached by `rl.algo.distill.Teacher.score`; None otherwise
    teacher_logprobs: Sequence[float] | np.ndarray | None = None


def trained_part(g: TokenGeneration) -> GenerationRecord:
    """`g` without the tokens after its last policy token (tool results after the last turn):
    they carry no loss and nothing after them is trained, and they may run past the context the
    sampler (and a batch row) holds. A generation without policy tokens keeps its first token."""
    mask = np.asarray(g.loss_mask)
    hits = np.flatnonzero(mask > 0)
    n = int(hits[-1]) + 1 if hits.size else 1
    routing = None if g.routing is None else np.asarray(g.routing)[:n]
    versions = None if g.versions is None else np.asarray(g.versions)[:n]
    teacher = getattr(g, "teacher_logprobs", None)
    teacher = None if teacher is None else np.asarray(teacher)[:n]
    return GenerationRecord(np.asarray(g.tokens)[:n], mask[:n], np.asarray(g.logprobs)[:n], versions, routing, teacher)


@dataclasses.dataclass
class ScoredRollout:
    """A finished rollout as the learner trains on it: its group (rollouts of one task sampled
    together), its reward (the composed reward, `rl.rewards.compose_reward`) and its generations
    (one, or a self-summarisation chain; e.g. `rl.agent.Rollout.generations`)."""

    group: Hashable
    reward: float
    generations: Sequence[TokenGeneration]


def _check(g: TokenGeneration, where: str, seq_len: int) -> None:
    n = len(g.tokens)
    if n < 1 or n > seq_len:
        raise ValueError(
            f"{where} has {n} tokens; a generation must have 1..seq_len={seq_len} tokens (raise train.seq_len "
            f"to the sampler's context budget)"
        )
    for name in ("loss_mask", "logprobs") + (("versions",) if g.versions is not None else ()):
        got = len(getattr(g, name))
        if got != n:
            raise ValueError(f"{where}: {name} has {got} entries for {n} tokens; give one per token")
    mask = np.asarray(g.loss_mask)
    if not np.isin(mask, (0, 1)).all():
        raise ValueError(f"{where}: loss_mask holds {sorted(set(mask.tolist()) - {0, 1})}; expected 0 or 1 per token")


def build_batch(
    rollouts: Sequence[ScoredRollout], cfg: Config, *, batch_size: int | None = None, seq_len: int | None = None
) -> dict[str, np.ndarray]:
    """The objective's batch (`rl.loss` module docstring), rows padded to [batch_size, seq_len]
    (default train.batch_size / train.seq_len): one row per generation, then all-padding rows.

    Keys: tokens int32, segment_ids int32 (1 on a row's tokens, 0 on padding), positions int32,
    loss_mask float32, advantages float32 (by rl.loss.advantage over the rollouts' rewards and
    groups; with rl.loss.objective=distill per token, `distill_advantages` of it and each
    generation's teacher_logprobs), sampler_logprobs float32, all [batch_size, seq_len]; and routing int32[batch_size,
    seq_len, moe_layers, k] when the objective replays routing (tokens without a record get
    experts 0..k-1). No ref_logprobs: when rl.loss.kl_coef > 0 add them with
    `rl.loss.reference_logprobs`. Over-long rollouts are not masked (Dr. GRPO): a generation
    ended by the token budget trains like any other."""
    batch_size = cfg.train.batch_size if batch_size is None else batch_size
    seq_len = cfg.train.seq_len if seq_len is None else seq_len
    rows = [(i, g) for i, r in enumerate(rollouts) for g in r.generations]
    if len(rows) > batch_size:
        raise ValueError(
            f"{len(rollouts)} rollouts hold {len(rows)} generations (rows) but batch_size={batch_size}; "
            f"sample fewer groups per step or raise train.batch_size"
        )
    for j, (i, g) in enumerate(rows):
        _check(g, f"rollout {i} (row {j})", seq_len)
    rewards = np.asarray([r.reward for r in rollouts], np.float64)
    adv = estimate_advantages(cfg.rl.loss.advantage, rewards, [r.group for r in rollouts])

    shape = (batch_size, seq_len)
    batch = {
        "tokens": np.zeros(shape, np.int32),
        "segment_ids": np.zeros(shape, np.int32),
        "positions": np.zeros(shape, np.int32),
        "loss_mask": np.zeros(shape, np.float32),
        "advantages": np.zeros(shape, np.float32),
        "sampler_logprobs": np.zeros(shape, np.float32),
    }
    replay = replays_routing(cfg)
    distill = cfg.rl.loss.objective == "distill"
    if replay:
        layers, k = cfg.model.num_moe_layers, cfg.model.num_experts_per_tok
        batch["routing"] = np.broadcast_to(np.arange(k, dtype=np.int32), shape + (layers, k)).copy()
    for j, (i, g) in enumerate(rows):
        n = len(g.tokens)
        mask = np.asarray(g.loss_mask, np.float32)
        batch["tokens"][j, :n] = np.asarray(g.tokens, np.int32)
        batch["segment_ids"][j, :n] = 1
        batch["positions"][j, :n] = np.arange(n)
        batch["loss_mask"][j, :n] = mask
        batch["advantages"][j, :n] = adv[i]
        batch["sampler_logprobs"][j, :n] = np.where(mask > 0, np.asarray(g.logprobs, np.float32), 0.0)
        if distill:
            teacher = getattr(g, "teacher_logprobs", None)
            if teacher is None or len(teacher) != n:
                raise ValueError(
                    f"rollout {i} (row {j}): rl.loss.objective=distill needs the teacher's log-probability of each "
                    f"of its {n} tokens (rl.algo.distill.Teacher.score attaches them); got "
                    f"{'none' if teacher is None else len(teacher)}"
                )
            d = cfg.rl.distill
            batch["advantages"][j, :n] = distill_advantages(
                adv[i], teacher, batch["sampler_logprobs"][j, :n], mask, weight=d.weight, task_weight=d.task_weight
            )
        if replay:
            where = f"rollout {i} (row {j})"
            if g.routing is None:
                raise ValueError(
                    f"{where} has no recorded routing but rl.loss.router_replay is on for this MoE model; record "
                    f"it with the in-process sampler, or set rl.loss.router_replay=false"
                )
            routing = np.asarray(g.routing)
            want = (cfg.model.num_moe_layers, cfg.model.num_experts_per_tok)
            if routing.ndim != 3 or routing.shape[1:] != want or not n - 1 <= routing.shape[0] <= n:
                raise ValueError(
                    f"{where}: routing of shape {routing.shape} for {n} tokens; expected [{n - 1} or {n}, "
                    f"{want[0]}, {want[1]}] (tokens, moe_layers, k)"
                )
            batch["routing"][j, : routing.shape[0]] = routing
    return batch


def version_lag(rollouts: Sequence[ScoredRollout], policy_version: int) -> dict[str, float]:
    """How stale the batch's policy tokens are: mean and max of policy_version minus the version
    that generated each policy token (0 in a synchronous loop). Generations without versions are
    skipped; {} when none has any."""
    lags = [
        policy_version - np.asarray(g.versions)[np.asarray(g.loss_mask) > 0]
        for r in rollouts
        for g in r.generations
        if g.versions is not None
    ]
    lag = np.concatenate(lags) if lags else np.zeros(0)
    if lag.size == 0:
        return {}
    return {"version_lag_mean": float(lag.mean()), "version_lag_max": float(lag.max())}
