"""The reinforcement-learning section: the policy-gradient objective and the reward's components.

Frozen dataclasses with no JAX import, attached to the top-level `Config` as `rl:` (defaults
apply when a run's YAML has no `rl` section, as for pretraining). Every value is checked when
the dataclass is built (`__post_init__` runs the section's `validate_*` function), so
`dataclasses.replace` in tests is checked as well.

Example (YAML):

    rl:
      loss:
        advantage: drgrpo          # reward minus group mean (Dr. GRPO); grpo also divides by the std
        aggregation: token_sum     # sum over tokens / a constant; token_mean, sequence_mean
        normalizer: 0              # the token_sum constant; 0 = batch rows x seq_len
        clip_eps_low: null         # PPO clipping of the importance ratio; null = no clipping
        clip_eps_high: null
        kl_coef: 0.0               # k1 KL to the frozen reference policy
        plausibility_band: [0.5, 2.0]   # tokens with trainer/sampler ratio outside get no loss
        importance: null           # ratio correction: null = band if plausibility_band else none;
        importance_cap: null       #   tis: weight min(r, cap); icepop: r outside [1/cap, cap] dropped
        router_replay: true
        objective: policy_gradient # distill: on-policy distillation from rl.distill's teacher
      distill: {teacher_url: "http://teacher:8000/v1", model: teacher, weight: 1.0, task_weight: 0.0}
      reward:
        grade_weight: 1.0
        length_penalty: {weight: 0.1, k: 0.01, q: 1.5, x: turns}
        broken_tool_call_penalty: 0.1
        style_penalty: 0.01
        parallel_tool_bonus: 0.05
        judges:                    # behaviour terms judged by a model (rl/judges/); none by default
          - {rubric: communication, weight: 0.1, endpoint: "http://127.0.0.1:8001/v1", model: judge}
          - {rubric: unsupported_claims, weight: 0.2, endpoint: "", api_key_env: ""}   # the rule alone

docs/rl.md gives the formulas.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from collections.abc import Collection, Sequence
from typing import Literal

from composer_jax.config.ray import RayConfig, validate_placement
from composer_jax.config.sampler import LEARNER_SAMPLER, SamplerConfig, validate_sampler
from composer_jax.config.supervision import SupervisionConfig, validate_supervision
from composer_jax.config.vllm import VLLMConfig
from composer_jax.errors import ConfigError

# The built-in names of `rl.loss.advantage` and `rl.loss.aggregation`, each set written once (the
# field's type; the tuple is derived from it); `rl/algo/advantages.py` and `rl/algo/loss.py` register one
# function under each (tests/rl hold the registries and these names equal).
AdvantageName = Literal["drgrpo", "grpo"]
ADVANTAGE_ESTIMATORS: tuple[str, ...] = typing.get_args(AdvantageName)
AggregationName = Literal["token_sum", "token_mean", "sequence_mean"]
AGGREGATIONS: tuple[str, ...] = typing.get_args(AggregationName)
# `rl.loss.importance`: the correction of the trainer/sampler importance ratio (`rl/algo/loss.py`'s
# importance registry): none, band (the plausibility band), tis (truncated), icepop (masked)
ImportanceName = Literal["none", "band", "tis", "icepop"]
IMPORTANCE_CORRECTIONS: tuple[str, ...] = typing.get_args(ImportanceName)
# `rl.loss.objective`: policy_gradient (the task reward's advantage alone) or distill (on-policy
# distillation: the task advantage mixed with the teacher's per-token log ratio, rl/algo/distill.py)
ObjectiveName = Literal["policy_gradient", "distill"]
OBJECTIVES: tuple[str, ...] = typing.get_args(ObjectiveName)
LengthMeasure = Literal["tokens", "turns", "tool_calls"]  # rl.reward.length_penalty.x (rl/algo/rewards.py)
LENGTH_MEASURES: tuple[str, ...] = typing.get_args(LengthMeasure)
STALENESS_UNITS = ("token", "group")
PUBLISH_DTYPES = ("", "bfloat16", "float32")
ENV_CORES = ("samplers", "all")  # rl.env_cores
SAMPLER_ENGINES = ("serve", "vllm")  # rl.sampler_engine
# rl.reward.judges[].rubric: the shipped rubrics (rl/judges/rubrics.py registers one under each; a
# test holds the two equal); RULED_RUBRICS have a rule-based check that runs without an endpoint
JudgeRubric = Literal["communication", "unsupported_claims"]
JUDGE_RUBRICS: tuple[str, ...] = typing.get_args(JudgeRubric)
RULED_RUBRICS = ("unsupported_claims",)


def _number(key: str, value: object, *, low: float | None = None, strict: bool = False) -> None:
    """A finite real number, at least `low` (above it when `strict`)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigError(f"{key}={value!r}: expected a finite number")
    if low is not None and (value <= low if strict else value < low):
        raise ConfigError(f"{key}={value!r}: expected a number {'>' if strict else '>='} {low}")


@dataclasses.dataclass(frozen=True)
class RLLossConfig:
    """The policy-gradient objective (`rl/algo/loss.py`; formulas in docs/rl.md)."""

    # advantage estimator: drgrpo = r - mean(group) (Dr. GRPO, as Composer 2); grpo = the same
    # divided by the group's standard deviation (DeepSeekMath)
    advantage: AdvantageName = "drgrpo"
    # how per-token terms become the loss: token_sum = sum / normalizer (Dr. GRPO: no per-sequence
    # length normalisation); token_mean = sum / policy tokens in the batch (DAPO); sequence_mean =
    # mean over sequences of each sequence's token mean (the original GRPO)
    aggregation: AggregationName = "token_sum"
    # the token_sum constant (e.g. max tokens per rollout x rollouts per batch); 0 = the batch's
    # rows x seq_len, a constant of the run
    normalizer: float = 0.0
    # PPO-style clipping of the trainer/sampler importance ratio to [1 - low, 1 + high] (DAPO's
    # clip-higher when high > low); None on a side = that side unclipped
    clip_eps_low: float | None = None
    clip_eps_high: float | None = None
    # weight of the k1 KL estimate to the frozen reference policy; 0 = no reference forward
    kl_coef: float = 0.0
    # [lo, hi]: a policy token whose trainer/sampler probability ratio lies outside gets no loss
    # (numerical mismatch between the two stacks); None = keep every token
    plausibility_band: tuple[float, ...] | None = None
    # the correction of the trainer/sampler ratio r (the importance registry of rl/algo/loss.py):
    # none = r as it is; band = the plausibility band above; tis = truncated importance sampling,
    # the token's weight min(r, importance_cap); icepop = masked importance sampling, a token whose r
    # leaves [1 / importance_cap, importance_cap] gets no loss. None (the default) = band when
    # plausibility_band is given, else none (the configs written before this key mean what they did)
    importance: ImportanceName | None = None
    # C of tis and icepop (> 1; e.g. 2); only with them
    importance_cap: float | None = None
    # policy_gradient: each token's advantage is its rollout's (the task reward's); distill:
    # rl.distill.task_weight times that plus rl.distill.weight times log teacher - log student of the
    # token (on-policy distillation, the teacher endpoint in rl.distill)
    objective: ObjectiveName = "policy_gradient"
    # replay the sampler's recorded MoE experts in the training forward (ignored for dense models)
    router_replay: bool = True
    # the sampling temperature: trainer log-probabilities are of softmax(logits / temperature), the
    # distribution the sampler drew from (top-k / top-p truncation is not modelled)
    temperature: float = 1.0

    def __post_init__(self) -> None:
        validate_rl_loss(self)
        if self.plausibility_band is not None:
            lo, hi = self.plausibility_band
            object.__setattr__(self, "plausibility_band", (float(lo), float(hi)))


@dataclasses.dataclass(frozen=True)
class DistillConfig:
    """The teacher of on-policy distillation (`rl.loss.objective: distill`, `rl/algo/distill.py`): an
    OpenAI-compatible /v1/completions endpoint answering vLLM's `prompt_logprobs` (vLLM, or
    `composer-jax serve`), asked for each sampled token's log-probability. The per-token advantage
    is task_weight * A_task + weight * (log teacher(t) - log student(t)), the student's being the
    sampler's recorded log-probability."""

    # the endpoint's base URL, up to /v1 (e.g. http://teacher:8000/v1)
    teacher_url: str = ""
    # the model name the endpoint serves (sent as `model`)
    model: str = ""
    # the name of the environment variable holding its bearer key ("" = no key sent)
    api_key_env: str = ""
    # the teacher's tokenizer (a directory or tokenizer.json); "" = the student's. Another tokenizer
    # is accepted only where it re-tokenises each rollout's text into the very same ids
    tokenizer: str = ""
    # w_distill: the weight of the reverse-KL term (log teacher - log student)
    weight: float = 1.0
    # w_task: the weight of the task reward's advantage (0 = pure distillation, the published recipe)
    task_weight: float = 0.0
    # seconds one scoring request may take
    timeout_s: float = 120.0
    # scoring requests in flight at once
    concurrency: int = 8

    def __post_init__(self) -> None:
        validate_distill(self)


def validate_distill(c: DistillConfig) -> None:
    """The rl.distill section's own checks (that distill has a teacher: `validate_rl`)."""
    if c.teacher_url and not (isinstance(c.teacher_url, str) and c.teacher_url.startswith(("http://", "https://"))):
        raise ConfigError(f"rl.distill.teacher_url={c.teacher_url!r}: expected an http:// or https:// URL (up to /v1)")
    _number("rl.distill.weight", c.weight, low=0.0)
    _number("rl.distill.task_weight", c.task_weight, low=0.0)
    _number("rl.distill.timeout_s", c.timeout_s, low=0.0, strict=True)
    if isinstance(c.concurrency, bool) or not isinstance(c.concurrency, int) or c.concurrency < 1:
        raise ConfigError(f"rl.distill.concurrency={c.concurrency!r}: expected an integer >= 1")


@dataclasses.dataclass(frozen=True)
class LengthPenaltyConfig:
    """C_{k,q}(x) = ((1 + k x)^(1 - q) - 1) / (k (1 - q)), log(1 + k x) / k at q = 1; subtracted
    from the reward with `weight`. q < 1 grows without bound (like x^(1-q)); q > 1 saturates at
    1 / (k (q - 1)), so long rollouts on hard tasks cost little more than medium ones."""

    weight: float = 0.0  # 0 = no length penalty
    k: float = 0.01
    q: float = 1.0
    x: LengthMeasure = "tokens"

    def __post_init__(self) -> None:
        validate_length_penalty(self)


@dataclasses.dataclass(frozen=True)
class JudgeConfig:
    """One behaviour term judged by a model (`rl/judges/`; docs/rl.md, *Judged behaviour terms*): a
    shipped rubric (a versioned prompt over the task, the final message, the diff and the tool
    results), its weight, and the OpenAI-compatible chat endpoint that judges (`composer-jax serve`,
    vLLM, a provider). A verdict not in within `timeout_s`, unparsable or refused is neutral (the
    term is 0 for that rollout) and counted."""

    rubric: JudgeRubric = "communication"
    weight: float = 0.0
    # the endpoint's base URL (".../v1"; chat/completions is posted under it); "" = no model: only a
    # rubric with a rule-based check (RULED_RUBRICS) accepts it, and then only the rule runs
    endpoint: str = ""
    model: str = ""  # the "model" field of the request (a serve replica's --model-name)
    api_key_env: str = ""  # the environment variable holding the bearer key; "" = no key sent
    # seconds a group's judging may take (queueing included): a verdict not in by then is a timeout
    timeout_s: float = 30.0
    concurrency: int = 8  # requests in flight to this judge at once, over all groups
    max_tokens: int = 256  # the verdict's token budget (room for a short reasoning and the SCORE line)
    max_input_chars: int = 4000  # each of the four inputs is cut to this many characters
    cache_size: int = 4096  # verdicts kept in memory (keyed by rubric, version, model and inputs)

    def __post_init__(self) -> None:
        validate_judge(self, "rl.reward.judges[]")


@dataclasses.dataclass(frozen=True)
class RewardConfig:
    """The reward of one rollout (`rl/algo/rewards.py`): the environment's grade times `grade_weight`,
    minus the length penalty, minus `broken_tool_call_penalty` per malformed or incomplete tool
    call, minus `style_penalty` per lint finding on the files the rollout changed, plus
    `parallel_tool_bonus` times the fraction of turns that issued several tool calls at once, plus
    each of `judges` (behaviour terms a model judges; none by default)."""

    grade_weight: float = 1.0
    length_penalty: LengthPenaltyConfig = dataclasses.field(default_factory=LengthPenaltyConfig)
    broken_tool_call_penalty: float = 0.0
    style_penalty: float = 0.0
    parallel_tool_bonus: float = 0.0
    judges: tuple[JudgeConfig, ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.judges, JudgeConfig):
            object.__setattr__(self, "judges", (self.judges,))
        object.__setattr__(self, "judges", tuple(self.judges))
        validate_reward(self)


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """Reinforcement learning (YAML section `rl`): the objective, the reward, and the learner's
    sampling (`rl/learner.py`). The optimiser, steps, batch rows (`train.batch_size`, one row per
    generation) and row length (`train.seq_len`, also the sampler's context) come from `train`;
    the agent's budgets from `agent`."""

    loss: RLLossConfig = dataclasses.field(default_factory=RLLossConfig)
    reward: RewardConfig = dataclasses.field(default_factory=RewardConfig)
    # the teacher endpoint of rl.loss.objective=distill
    distill: DistillConfig = dataclasses.field(default_factory=DistillConfig)
    # tasks trained on, in turn: task ids, or gen/FAMILY (a generated task, new seed per group)
    tasks: tuple[str, ...] = ()
    task_seed: int = 0  # group i of a gen/ task uses seed task_seed + i
    group_size: int = 8  # rollouts per task sampled together (the advantage baseline's group)
    groups_per_step: int = 4
    # environment servers: URLs (token from env_token or COMPOSER_JAX_ENV_TOKEN); none = start
    # env_servers local servers on tasks_dir (the embedded default)
    env_urls: tuple[str, ...] = ()
    env_token: str = ""
    env_servers: int = 1
    tasks_dir: str = "tasks"
    # while no environment server answers /health (all dead, restarting or unreachable) no group
    # starts; the run fails with an error after env_wait_s seconds of that
    env_wait_s: float = 300.0
    # the samplers' settings (config/sampler.py): the in-process sampler's and every local replica's
    sampler: SamplerConfig = dataclasses.field(default_factory=lambda: LEARNER_SAMPLER)
    # held-out evaluation every eval_every steps (0 = at the start and end only): eval_samples per
    # task; gen/ families evaluated on eval_seeds seeds from eval_seed (keep them apart from training's)
    eval_tasks: tuple[str, ...] = ()
    eval_every: int = 0
    eval_samples: int = 4
    eval_seeds: int = 8
    eval_seed: int = 1_000_000
    # the rollout queue (rl/rollout/queue.py): groups are trained at most max_staleness policy versions
    # after the version that sampled them (0 = the synchronous learner), counted per token (the
    # oldest policy token) or per group (the version the group started at); older groups are
    # dropped whole. max_groups_in_flight bounds the groups being sampled at once and queue_size
    # the finished groups waiting for the trainer (0 = only the staleness bound limits them).
    max_staleness: int = 0
    staleness_unit: str = "token"
    max_groups_in_flight: int = 0
    queue_size: int = 0
    # a tensorstore kvstore URL (file://DIR, gs://...) each new policy version is published to for
    # samplers in other processes (weightsync/publisher.py); empty = none
    weight_store: str = ""
    # the dtype of the published copy: "" = as trained; "bfloat16" = a bf16 copy (smaller deltas:
    # entries change only when an update crosses a bf16 rounding step; samplers then run in bf16)
    publish_dtype: str = ""
    # samplers in other processes (rl/samplers/serve.py): the URLs of `composer-jax serve` replicas
    # following rl.weight_store (bearer key from sampler_token or COMPOSER_JAX_SAMPLER_TOKEN), or
    # local_samplers replicas started by the run itself as child processes (rl/samplers/serve_launch.py; the
    # weight store defaults to OUT_DIR/weight_store). Neither: the in-process sampler.
    sampler_urls: tuple[str, ...] = ()
    sampler_token: str = ""
    local_samplers: int = 0
    # what the replicas are: "serve" (composer-jax serve) or "vllm" (vLLM through its token-in/token-out
    # generate endpoint; config/vllm.py, rl/samplers/vllm.py); vllm: its settings
    sampler_engine: str = "serve"
    vllm: VLLMConfig = dataclasses.field(default_factory=VLLMConfig)
    # pin the trainer's threads to the first core this process may use and local replica i to the
    # (i+1)-th (as on separate accelerators); needs 1 + local_samplers cores
    pin_cores: bool = False
    # with pin_cores: whether the trainer gets a core of its own (true: the first core, replica i the
    # (i+1)-th; needs 1 + local_samplers cores) or runs on every core while replica i takes the i-th
    # (false; needs local_samplers cores): on few cores a trainer that waits on rollouts leaves its
    # core idle most of a step, and a replica there uses it
    pin_trainer: bool = True
    # with pin_cores, where the local environment servers (and the sandboxes they start) run:
    # "samplers", the replicas' cores; "all", every core this process may use, the trainer's too
    # (the scheduler puts them where a core is idle)
    env_cores: str = "samplers"
    # the local (or Ray-placed) environment servers' grade cache (`env-server --grade-cache N`): a
    # rollout whose carried change equals one graded before on the same task (same files, modes and
    # bytes) gets that grade's verdict without running the tests again; N verdicts kept, 0 = off
    env_grade_cache: int = 0
    # the local children's restart policy and health probes, and how long rollouts wait for a
    # restarted replica to rejoin (config/supervision.py)
    supervision: SupervisionConfig = dataclasses.field(default_factory=SupervisionConfig)
    # where the services the run starts (environment servers, sampler replicas) run: "local", child
    # processes of the run on 127.0.0.1 (runtime/local.py); "ray", Ray actors placed on a cluster's
    # nodes as rl.ray says (config/ray.py, runtime/ray_placement.py)
    placement: str = "local"
    ray: RayConfig = dataclasses.field(default_factory=RayConfig)

    # keys of earlier releases, now elsewhere: a config that gives one is told where (config/loader.py)
    MOVED_KEYS: typing.ClassVar[dict[str, str]] = {
        "sampler_slots": "rl.sampler.slots",
        "sampler_prefix_cache": "rl.sampler.prefix_cache",
        "sampler_warm_up": "rl.sampler.warm_up",
        "sampler_poll_s": "rl.sampler.poll_s",
    }

    def __post_init__(self) -> None:
        for name in ("tasks", "env_urls", "eval_tasks", "sampler_urls"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = (value,)
            object.__setattr__(self, name, tuple(value))
        validate_rl(self)  # built directly by code too (tests, `dataclasses.replace`): checked when built


def validate_rl_loss(c: RLLossConfig) -> None:
    """The rl.loss section's checks."""
    if c.advantage not in ADVANTAGE_ESTIMATORS:
        raise ConfigError(f"rl.loss.advantage={c.advantage!r} is not accepted; accepted: {ADVANTAGE_ESTIMATORS}")
    if c.objective not in OBJECTIVES:
        raise ConfigError(f"rl.loss.objective={c.objective!r} is not accepted; accepted: {OBJECTIVES}")
    if c.aggregation not in AGGREGATIONS:
        raise ConfigError(f"rl.loss.aggregation={c.aggregation!r} is not accepted; accepted: {AGGREGATIONS}")
    _number("rl.loss.normalizer", c.normalizer, low=0.0)
    for side in ("low", "high"):
        eps = getattr(c, f"clip_eps_{side}")
        if eps is not None:
            _number(f"rl.loss.clip_eps_{side}", eps, low=0.0, strict=True)
    if c.clip_eps_low is not None and c.clip_eps_low >= 1.0:
        raise ConfigError(
            f"rl.loss.clip_eps_low={c.clip_eps_low!r}: expected a number in (0, 1) (the ratio's lower "
            f"bound 1 - eps must stay positive), or null for no lower clip"
        )
    _number("rl.loss.kl_coef", c.kl_coef, low=0.0)
    if c.plausibility_band is not None:
        band = tuple(c.plausibility_band)
        if len(band) != 2:
            raise ConfigError(
                f"rl.loss.plausibility_band={list(band)!r}: expected [lo, hi] with 0 <= lo < 1 < hi, or null"
            )
        lo, hi = band
        _number("rl.loss.plausibility_band[0]", lo, low=0.0)
        _number("rl.loss.plausibility_band[1]", hi)
        if not lo < 1.0 < hi:
            raise ConfigError(
                f"rl.loss.plausibility_band={[lo, hi]!r}: expected [lo, hi] with 0 <= lo < 1 < hi (a band that "
                f"keeps tokens on which trainer and sampler agree), or null to keep every token"
            )
    _number("rl.loss.temperature", c.temperature, low=0.0, strict=True)
    _check_importance(c)


def importance_correction(c: RLLossConfig) -> str:
    """The importance correction a loss config asks for: `importance`, or when that is None, band
    with a plausibility_band and none without (what a config that predates the key meant)."""
    if c.importance is not None:
        return c.importance
    return "band" if c.plausibility_band is not None else "none"


def _check_importance(c: RLLossConfig) -> None:
    """rl.loss.importance against plausibility_band and importance_cap: each key only where it acts."""
    if c.importance is not None and c.importance not in IMPORTANCE_CORRECTIONS:
        raise ConfigError(
            f"rl.loss.importance={c.importance!r} is not accepted; accepted: {IMPORTANCE_CORRECTIONS} or null"
        )
    name = importance_correction(c)
    capped = name in ("tis", "icepop")
    if name == "band" and c.plausibility_band is None:
        raise ConfigError(
            "rl.loss.importance='band' needs rl.loss.plausibility_band: [lo, hi] (the ratios kept), e.g. [0.5, 2.0]"
        )
    if name != "band" and c.plausibility_band is not None:
        raise ConfigError(
            f"rl.loss.plausibility_band={list(c.plausibility_band)!r} with rl.loss.importance={name!r}: the band is "
            f"the 'band' correction; give importance: band (or null), or plausibility_band: null"
        )
    if capped:
        if c.importance_cap is None:
            raise ConfigError(f"rl.loss.importance={name!r} needs rl.loss.importance_cap: C > 1 (e.g. 2.0)")
        _number("rl.loss.importance_cap", c.importance_cap, low=1.0, strict=True)
    elif c.importance_cap is not None:
        raise ConfigError(
            f"rl.loss.importance_cap={c.importance_cap!r} with rl.loss.importance={name!r}: the cap is C of "
            f"'tis' and 'icepop' only; drop it or choose one of them"
        )


def validate_length_penalty(c: LengthPenaltyConfig) -> None:
    """The rl.reward.length_penalty section's checks."""
    _number("rl.reward.length_penalty.weight", c.weight, low=0.0)
    _number("rl.reward.length_penalty.k", c.k, low=0.0, strict=True)
    _number("rl.reward.length_penalty.q", c.q)
    if c.x not in LENGTH_MEASURES:
        raise ConfigError(f"rl.reward.length_penalty.x={c.x!r} is not accepted; accepted: {LENGTH_MEASURES}")


def validate_reward(c: RewardConfig) -> None:
    """The rl.reward section's checks (its length penalty's included)."""
    validate_length_penalty(c.length_penalty)
    for key in ("grade_weight", "broken_tool_call_penalty", "style_penalty", "parallel_tool_bonus"):
        # signs are in the formula: a penalty is given as a size (>= 0) and subtracted
        _number(f"rl.reward.{key}", getattr(c, key), low=0.0)
    seen: set[str] = set()
    for i, judge in enumerate(c.judges):
        key = f"rl.reward.judges[{i}]"
        if not isinstance(judge, JudgeConfig):
            raise ConfigError(f"{key}={judge!r}: expected a judge section (rubric, weight, endpoint, ...)")
        validate_judge(judge, key)
        if judge.rubric in seen:
            raise ConfigError(
                f"{key}.rubric={judge.rubric!r} is given twice: each rubric is one term (reward/judge_{judge.rubric}); "
                "give it once"
            )
        seen.add(judge.rubric)


def validate_judge(c: JudgeConfig, key: str) -> None:
    """One rl.reward.judges entry's checks (`key` names it in errors)."""
    if c.rubric not in JUDGE_RUBRICS:
        raise ConfigError(f"{key}.rubric={c.rubric!r} is not accepted; accepted: {', '.join(JUDGE_RUBRICS)}")
    _number(f"{key}.weight", c.weight, low=0.0)
    if not isinstance(c.endpoint, str) or (c.endpoint and not c.endpoint.startswith(("http://", "https://"))):
        raise ConfigError(f"{key}.endpoint={c.endpoint!r}: expected an http:// or https:// URL (the API base, .../v1)")
    if not c.endpoint and c.rubric not in RULED_RUBRICS:
        raise ConfigError(
            f"{key}.endpoint='' with rubric {c.rubric!r}: this rubric has no rule-based check, so it needs a "
            f"judge: give the endpoint's URL (rubrics that run without one: {', '.join(RULED_RUBRICS)})"
        )
    for name in ("model", "api_key_env"):
        if not isinstance(getattr(c, name), str):
            raise ConfigError(f"{key}.{name}={getattr(c, name)!r}: expected a string")
    if c.api_key_env and not c.api_key_env.replace("_", "").isalnum():
        raise ConfigError(
            f"{key}.api_key_env={c.api_key_env!r}: expected the NAME of an environment variable (letters, digits, "
            "underscores), not the key itself"
        )
    _number(f"{key}.timeout_s", c.timeout_s, low=0.0, strict=True)
    for name, low in (("concurrency", 1), ("max_tokens", 1), ("max_input_chars", 100), ("cache_size", 0)):
        value = getattr(c, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"{key}.{name}={value!r}: expected an integer >= {low}")


def tensor_parallel_size(args: Sequence[str]) -> int:
    """vLLM's `--tensor-parallel-size N` (or `-tp N`, `--tensor-parallel-size=N`) in `args`; 1 without."""
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if name in ("--tensor-parallel-size", "-tp"):
            raw = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            if raw.isdigit():
                return int(raw)
    return 1


def validate_rl(r: RLConfig) -> None:
    """The rl section's own checks, its sub-sections' included (the learner's checks against `train`
    and `agent`: `config/run.py`'s `check_rl_run`)."""
    validate_rl_loss(r.loss)
    validate_reward(r.reward)
    validate_distill(r.distill)
    if r.loss.objective == "distill" and not (r.distill.teacher_url and r.distill.model):
        raise ConfigError(
            "rl.loss.objective='distill' needs a teacher: rl.distill.teacher_url (its /v1 base URL) and "
            "rl.distill.model (the name it serves)"
        )
    if r.loss.objective == "distill" and r.distill.weight == 0 and r.distill.task_weight == 0:
        raise ConfigError("rl.distill.weight=0 and rl.distill.task_weight=0: every advantage would be 0; raise one")
    validate_sampler(r.sampler, "rl.sampler")
    validate_supervision(r.supervision)
    validate_placement(r.placement)
    if r.placement == "ray" and r.pin_cores:
        raise ConfigError(
            "rl.pin_cores=true pins the run's own child processes to cores; with rl.placement=ray Ray places "
            "the services (rl.ray sets what each asks for): drop one of them"
        )
    if r.placement == "ray" and r.sampler_engine == "vllm" and r.local_samplers:
        tp = tensor_parallel_size(r.vllm.extra_args)
        if tp > max(1, r.ray.sampler_gpus):
            raise ConfigError(
                f"rl.vllm.extra_args run each vLLM replica on {tp} GPUs (--tensor-parallel-size) but "
                f"rl.ray.sampler_gpus={r.ray.sampler_gpus} asks Ray for fewer per replica: set rl.ray.sampler_gpus={tp}"
            )
    for name, low in (("group_size", 2), ("groups_per_step", 1), ("env_servers", 1)):
        value = getattr(r, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise ConfigError(f"rl.{name}={value!r}: expected an integer >= {low}")
    for name in (
        "eval_every",
        "eval_samples",
        "eval_seeds",
        "max_staleness",
        "max_groups_in_flight",
        "queue_size",
        "local_samplers",
    ):
        value = getattr(r, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"rl.{name}={value!r}: expected an integer >= 0")
    for name in ("env_urls", "sampler_urls"):
        urls = getattr(r, name)
        bad = [u for u in urls if not isinstance(u, str) or not u.startswith(("http://", "https://"))]
        if bad:
            raise ConfigError(f"rl.{name}={list(urls)!r}: {bad[0]!r} is not an http:// or https:// URL")
    if r.sampler_urls and r.local_samplers:
        raise ConfigError(
            f"rl.sampler_urls={list(r.sampler_urls)!r} and rl.local_samplers={r.local_samplers}: give one "
            "(replicas to use, or the number to start), not both"
        )
    if r.sampler_engine not in SAMPLER_ENGINES:
        raise ConfigError(
            f"rl.sampler_engine={r.sampler_engine!r} is not accepted; accepted: "
            + " or ".join(map(repr, SAMPLER_ENGINES))
        )
    if r.sampler_engine == "vllm":
        _check_vllm_replicas(r)
    elif r.sampler_urls and not r.weight_store:
        raise ConfigError(
            "rl.sampler_urls needs rl.weight_store: the URL the replicas follow for new policy versions "
            "(the same one their `composer-jax serve --weights-from` names)"
        )
    if r.publish_dtype not in PUBLISH_DTYPES:
        raise ConfigError(
            f"rl.publish_dtype={r.publish_dtype!r} is not accepted; accepted: one of "
            + ", ".join(repr(d) for d in PUBLISH_DTYPES)
        )
    if isinstance(r.env_wait_s, bool) or not isinstance(r.env_wait_s, int | float) or not r.env_wait_s > 0:
        raise ConfigError(f"rl.env_wait_s={r.env_wait_s!r}: expected seconds > 0")
    if not isinstance(r.pin_cores, bool):
        raise ConfigError(f"rl.pin_cores={r.pin_cores!r}: expected true or false")
    g = r.env_grade_cache
    if isinstance(g, bool) or not isinstance(g, int) or g < 0:
        raise ConfigError(f"rl.env_grade_cache={g!r}: expected an integer >= 0 (verdicts kept; 0 = off)")
    if not isinstance(r.pin_trainer, bool):
        raise ConfigError(f"rl.pin_trainer={r.pin_trainer!r}: expected true or false")
    if r.env_cores not in ENV_CORES:
        raise ConfigError(
            f"rl.env_cores={r.env_cores!r} is not accepted; accepted: " + " or ".join(repr(m) for m in ENV_CORES)
        )
    if r.staleness_unit not in STALENESS_UNITS:
        raise ConfigError(
            f"rl.staleness_unit={r.staleness_unit!r} is not accepted; accepted: one of "
            + ", ".join(repr(u) for u in STALENESS_UNITS)
        )
    if not isinstance(r.weight_store, str) or (r.weight_store and "://" not in r.weight_store):
        raise ConfigError(
            f"rl.weight_store={r.weight_store!r}: expected a tensorstore kvstore URL "
            "(file://DIR, gs://BUCKET/PATH, ...) or empty for none"
        )


def _check_vllm_replicas(r: RLConfig) -> None:
    """vLLM replicas: where they come from must fit how they get new versions."""
    how = r.vllm.weight_update
    if not r.sampler_urls and not r.local_samplers:
        raise ConfigError(
            "rl.sampler_engine='vllm' needs replicas: rl.local_samplers=N (started by the run, new versions by "
            "restart) or rl.sampler_urls (running replicas, new versions over NCCL: rl.vllm.weight_update=nccl)"
        )
    if how == "restart" and r.sampler_urls:
        raise ConfigError(
            f"rl.vllm.weight_update='restart' with rl.sampler_urls={list(r.sampler_urls)!r}: the run can restart "
            "only replicas it started (rl.local_samplers); replicas by URL take versions with weight_update=nccl"
        )
    if how == "nccl" and not r.vllm.nccl_host and r.sampler_urls:
        raise ConfigError(
            "rl.vllm.weight_update='nccl' needs rl.vllm.nccl_host: the address of this trainer the replicas "
            "join the NCCL group at"
        )


def replica_cores(r: RLConfig, usable: Collection[int]) -> list[int] | None:
    """The cores `rl.pin_cores` gives the rl.local_samplers replicas (replica i the i-th of the list;
    the local environment servers share them with env_cores: samplers), of the cores this process
    may use; None without pin_cores. With pin_trainer the first core is the trainer's and the
    replicas take the next ones; without it they take the first ones and the trainer keeps them all."""
    if not r.pin_cores:
        return None
    first = 1 if r.pin_trainer else 0
    return sorted(usable)[first : first + r.local_samplers]
