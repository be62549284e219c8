"""The agent section: how one rollout talks to its environment (budgets, self-summarisation, retries).

agent:
  max_turns: 16            # assistant turns per rollout, summaries included
  max_turn_tokens: 512     # tokens one assistant turn may generate
  max_rollout_tokens: 8192 # tokens the whole rollout may generate, over all its generations
  context_budget: 4096     # a generation's context size that triggers self-summarisation (0: never)
"""

from __future__ import annotations

import dataclasses

from composer_jax.errors import ConfigError

DEFAULT_SUMMARY_PROMPT = (
    "Your context is nearly full. Write a summary of your progress so far for yourself to continue from: "
    "what the task is, what you found, what you changed (files and how), and what remains to do. "
    "Do not call any tool in this answer."
)


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """One rollout: a conversation with an environment until the model answers without a tool call,
    a budget ends, or the environment fails (then the rollout restarts on another server).

    Self-summarisation (Composer 2): when a generation's context plus the next turn's tokens would
    pass `context_budget`, the model is asked for a summary (`summary_prompt`, at most
    `summary_tokens`), and a new generation starts from the task and that summary. All generations
    of a rollout share its final reward."""

    max_turns: int = 16
    max_turn_tokens: int = 512
    max_rollout_tokens: int = 8192
    context_budget: int = 4096  # 0 disables self-summarisation (the rollout ends when the context is full)
    max_summaries: int = 4
    summary_tokens: int = 256
    summary_prompt: str = DEFAULT_SUMMARY_PROMPT
    system_prompt: str = ""  # "" = the environment protocol's system prompt (what SFT data uses)
    max_tool_calls_per_turn: int = 8  # calls past this get an error observation
    max_observation_chars: int = 4000  # a tool result longer than this is cut (and says so)
    env_retries: int = 2  # restarts of a rollout whose environment server failed
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    def __post_init__(self) -> None:
        validate_agent(self)  # built directly by code too (rollouts, tests): checked when built

    @property
    def summarise(self) -> bool:
        return self.context_budget > 0 and self.max_summaries > 0


def validate_agent(a: AgentConfig) -> None:
    """The agent section's checks (each names the key, the value and what is accepted)."""
    positive = ("max_turns", "max_turn_tokens", "max_rollout_tokens", "summary_tokens", "max_tool_calls_per_turn")
    for name in positive:
        if getattr(a, name) < 1:
            raise ConfigError(f"agent.{name}={getattr(a, name)!r} must be >= 1")
    for name in ("context_budget", "max_summaries", "env_retries", "max_observation_chars", "top_k"):
        if getattr(a, name) < 0:
            raise ConfigError(f"agent.{name}={getattr(a, name)!r} must be >= 0")
    if a.context_budget and a.context_budget <= a.max_turn_tokens:
        raise ConfigError(
            f"agent.context_budget={a.context_budget} must exceed agent.max_turn_tokens="
            f"{a.max_turn_tokens} (a turn must fit in a generation), or be 0 to disable summarisation"
        )
    if not a.temperature >= 0:
        raise ConfigError(f"agent.temperature={a.temperature!r} must be >= 0 (0 = greedy)")
    if not 0 < a.top_p <= 1:
        raise ConfigError(f"agent.top_p={a.top_p!r} must be in (0, 1]")
