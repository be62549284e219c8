"""Rollout rewards: the environment's grade, the nonlinear length penalty and the auxiliary
behaviour rewards of Composer 2 (report section 4), each weighted by `rl.reward` and returned
separately so that every component is logged. The behaviour terms a model judges (`rl.reward.judges`)
are computed by `rl/judges/` and added here as `JudgedTerm`s (`with_judged`).

Host-side numpy: rewards are per rollout, computed by the learner after the environment grades
the rollout; the loss (`rl/algo/loss.py`) only sees the resulting advantages.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from composer_jax.config.rl import LENGTH_MEASURES, LengthPenaltyConfig, RewardConfig

# below this |(1 - q) log(1 + k x)| the q = 1 log limit's series is used (see `length_penalty`)
_SERIES_BELOW = 1e-5


@dataclasses.dataclass(frozen=True)
class RolloutStats:
    """What the agent loop measured of one finished rollout (all generations of a
    self-summarisation chain together).

    grade: the environment's score (e.g. 1.0 when the tests pass; 0 for a rollout whose grade names
    tampering, `Rollout.env_reward`); tokens: policy-generated
    tokens; turns: model turns; tool_calls: tool calls issued; broken_tool_calls: malformed or
    incomplete tool calls (answered with an error observation); parallel_tool_turns: turns that
    issued more than one tool call; lint_findings: lint findings on the files the rollout changed,
    computed in the sandbox (None when the environment does not lint; the style term is then 0)."""

    grade: float
    tokens: int
    turns: int
    tool_calls: int
    broken_tool_calls: int = 0
    parallel_tool_turns: int = 0
    lint_findings: int | None = None

    def __post_init__(self) -> None:
        for key in ("tokens", "turns", "tool_calls", "broken_tool_calls", "parallel_tool_turns"):
            if getattr(self, key) < 0:
                raise ValueError(f"RolloutStats.{key}={getattr(self, key)!r} must be >= 0")
        if self.lint_findings is not None and self.lint_findings < 0:
            raise ValueError(f"RolloutStats.lint_findings={self.lint_findings!r} must be >= 0 or None")
        if self.parallel_tool_turns > self.turns:
            raise ValueError(f"RolloutStats.parallel_tool_turns={self.parallel_tool_turns} exceeds turns={self.turns}")


def length_penalty(x: float | np.ndarray, k: float, q: float) -> np.ndarray:
    """C_{k,q}(x) = ((1 + k x)^(1 - q) - 1) / (k (1 - q)); at q = 1 its limit log(1 + k x) / k.

    x >= 0 (scalar or array); k > 0. float64. Written as expm1(a L) / (k a) with a = 1 - q and
    L = log1p(k x), which is accurate for any a != 0 (expm1 keeps the relative precision that
    (1 + kx)^a - 1 loses to cancellation near q = 1); when |a L| is below 1e-5 the series
    L (1 + aL/2 + (aL)^2/6) / k is used instead, exact to float64 precision there and equal to
    the log limit at a = 0. C is increasing in x with C(0) = 0 and C'(0) = 1 for every q."""
    x = np.asarray(x, np.float64)
    if np.any(x < 0) or not np.all(np.isfinite(x)):
        raise ValueError(f"length_penalty: x must be finite and >= 0, got {x!r}")
    if not k > 0:
        raise ValueError(f"length_penalty: k={k!r} must be > 0")
    a = 1.0 - float(q)
    log_term = np.log1p(k * x)
    al = a * log_term
    small = np.abs(al) < _SERIES_BELOW
    series = log_term * (1.0 + al / 2.0 + al * al / 6.0) / k
    exact = np.expm1(al) / (k * a) if a != 0.0 else series
    return np.where(small, series, exact)


def length_measure(stats: RolloutStats, x: str) -> int:
    """The quantity the length penalty is over: tokens, turns or tool_calls."""
    if x not in LENGTH_MEASURES:
        raise ValueError(f"length penalty x={x!r} is not accepted; accepted: {', '.join(LENGTH_MEASURES)}")
    return int(getattr(stats, x))


# how a judged term's verdict came about (`JudgedTerm.outcome`; rl/judges/panel.py says when each
# happens), and the per-step count each is logged as, reward/judge_<name>_<count>; the last five
# outcomes are neutral (the term is 0)
OUTCOME_COUNTS = {
    "verdict": "verdicts",
    "rule": "rule_penalised",
    "timeout": "timeouts",
    "unparsable": "unparsable",
    "error": "errors",
    "no_message": "no_message",
    "no_judge": "no_judge",
}
JUDGE_OUTCOMES = tuple(OUTCOME_COUNTS)
NEUTRAL_OUTCOMES = JUDGE_OUTCOMES[2:]


@dataclasses.dataclass(frozen=True)
class JudgedTerm:
    """One judged behaviour term of one rollout (rl/judges/): `value` is weighted and signed (what
    the total gets), `score` the verdict in [0, 1] (None when there is none), `version` the rubric's
    version, `cached` whether the verdict came from the cache (or another rollout of the same batch
    with the same inputs) rather than a request of its own."""

    name: str
    version: int
    value: float
    outcome: str
    score: float | None = None
    cached: bool = False

    def __post_init__(self) -> None:
        if self.outcome not in JUDGE_OUTCOMES:
            raise ValueError(f"JudgedTerm.outcome={self.outcome!r}; accepted: {', '.join(JUDGE_OUTCOMES)}")
        if self.outcome in NEUTRAL_OUTCOMES and self.value != 0.0:
            raise ValueError(f"JudgedTerm {self.name}: outcome {self.outcome!r} is neutral, value={self.value!r}")


@dataclasses.dataclass(frozen=True)
class RewardBreakdown:
    """One rollout's reward and its components, each already weighted and signed so that
    total = grade + length_penalty + broken_tool_calls + style + parallel_tool_use + the values
    of `judged` (one per `rl.reward.judges` entry; empty without judges)."""

    total: float
    grade: float
    length_penalty: float
    broken_tool_calls: float
    style: float
    parallel_tool_use: float
    judged: tuple[JudgedTerm, ...] = ()

    def as_dict(self) -> dict:
        """JSON-ready (the persisted group's record; `judged` only when there are judged terms, so
        a run without judges records what it did before them); `from_dict` reads it back."""
        d = dataclasses.asdict(self)
        if not self.judged:
            del d["judged"]
        return d

    @classmethod
    def from_dict(cls, d: dict) -> RewardBreakdown:
        """The inverse of `as_dict` (a record without `judged`, of a run without judges, included)."""
        judged = tuple(JudgedTerm(**t) for t in d.get("judged", ()))
        return cls(**{**d, "judged": judged})


def with_judged(b: RewardBreakdown, terms: Sequence[JudgedTerm]) -> RewardBreakdown:
    """`b` with the judged terms added to its total (they replace any `b` had)."""
    base = b.total - sum(t.value for t in b.judged)
    return dataclasses.replace(b, total=base + sum(t.value for t in terms), judged=tuple(terms))


def compose_reward(stats: RolloutStats, cfg: RewardConfig) -> RewardBreakdown:
    """r = w_g grade - w_L C_{k,q}(x) - w_b broken_tool_calls - w_s lint_findings
    + w_p parallel_tool_turns / turns  (the weights of `cfg`; see docs/rl.md)."""
    lp: LengthPenaltyConfig = cfg.length_penalty
    grade = cfg.grade_weight * float(stats.grade)
    # (+ 0.0 turns a zero penalty's -0.0 into 0.0 for the logs)
    length = -lp.weight * float(length_penalty(length_measure(stats, lp.x), lp.k, lp.q)) + 0.0
    broken = -cfg.broken_tool_call_penalty * stats.broken_tool_calls + 0.0
    style = -cfg.style_penalty * (stats.lint_findings or 0) + 0.0
    # a fraction of turns, not a count: a count would reward splitting work into more turns
    parallel = cfg.parallel_tool_bonus * stats.parallel_tool_turns / max(stats.turns, 1)
    total = grade + length + broken + style + parallel
    return RewardBreakdown(total, grade, length, broken, style, parallel)


def mean_components(breakdowns: Sequence[RewardBreakdown]) -> dict[str, float]:
    """The mean of every component over rollouts, keyed `reward/<component>` (for logging). A judged
    term is `reward/judge_<name>` (its mean value, 0 for a rollout without it), beside its rubric's
    `_version` (the newest among the rollouts), the mean `_score` of the rollouts with one, and the
    counts over the rollouts of `_cached` verdicts and of each outcome (`OUTCOME_COUNTS`: `_verdicts`,
    `_rule_penalised`, `_timeouts`, `_unparsable`, `_errors`, `_no_message`, `_no_judge`)."""
    if not breakdowns:
        return {}
    fields = [f.name for f in dataclasses.fields(RewardBreakdown) if f.name != "judged"]
    out = {f"reward/{f}": float(np.mean([getattr(b, f) for b in breakdowns])) for f in fields}
    names = sorted({t.name for b in breakdowns for t in b.judged})
    for name in names:
        terms = [t for b in breakdowns for t in b.judged if t.name == name]
        key = f"reward/judge_{name}"
        out[key] = float(sum(t.value for t in terms) / len(breakdowns))
        out[key + "_version"] = float(max(t.version for t in terms))
        scores = [t.score for t in terms if t.score is not None]
        if scores:
            out[key + "_score"] = float(np.mean(scores))
        out[key + "_cached"] = float(sum(t.cached for t in terms))
        for outcome, count in OUTCOME_COUNTS.items():
            out[f"{key}_{count}"] = float(sum(t.outcome == outcome for t in terms))
    return out
