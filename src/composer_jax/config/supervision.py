"""The `rl.supervision` section: how a run keeps its local children (environment servers, serve and
vLLM replicas) up, and how long it waits for a replica to come back.

The restart policy and the health probes are the supervisor's (runtime/local.py,
`RestartPolicy`, built from this section for every launcher of the run); `rejoin_timeout_s` is the
rollout side's (rl/rollout/rejoin.py): while no replica is in rotation, a rollout waits at most this
long for a restarted one to rejoin, then the run fails with an error naming each replica and its
last failure.

Example (YAML):

    rl:
      supervision:
        max_restarts: 5          # restarts of one child within window_s before it is given up on
        window_s: 600
        backoff_s: 1.0           # the first restart's delay, doubled per restart within the window
        max_backoff_s: 30
        health_interval_s: 10    # a running child is asked GET /health this often (0: never)
        health_failures: 3       # failed probes in a row that make it hung: killed and restarted
        rejoin_timeout_s: 900    # the longest wait with no replica in rotation

docs/rl.md ("Supervision: replicas that die or hang") says what happens when.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Protocol

from composer_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class SupervisionConfig:
    """The restart policy of a run's children and the rejoin bound (module docstring)."""

    max_restarts: int = 5
    window_s: float = 600.0
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    health_interval_s: float = 10.0
    health_failures: int = 3
    # a restarted serve replica imports JAX, reads a checkpoint and loads the current version: about
    # a minute on one CPU core; with rl.sampler.warm_up its compilation may take many minutes more
    rejoin_timeout_s: float = 900.0

    def __post_init__(self) -> None:
        validate_supervision(self)


class RestartValues(Protocol):
    """A restart policy's values: this section's, or runtime/local.py's RestartPolicy."""

    @property
    def max_restarts(self) -> int: ...
    @property
    def window_s(self) -> float: ...
    @property
    def backoff_s(self) -> float: ...
    @property
    def max_backoff_s(self) -> float: ...
    @property
    def health_interval_s(self) -> float: ...
    @property
    def health_failures(self) -> int: ...


def policy_problem(c: RestartValues, key: str = "") -> str | None:
    """What is wrong with a restart policy's values (and rejoin_timeout_s where `c` has one), as
    "KEYname=value: expected ..."; None when every value is in range."""
    for name, low in (("max_restarts", 0), ("health_failures", 1)):
        value = getattr(c, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            never = " (0: never restart)" if name == "max_restarts" else ""
            return f"{key}{name}={value!r}: expected an integer >= {low}{never}"
    for name in ("window_s", "backoff_s", "max_backoff_s", "health_interval_s", "rejoin_timeout_s"):
        if not hasattr(c, name):
            continue
        value, strict = getattr(c, name), name != "health_interval_s"
        ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or (value <= 0 if strict else value < 0):
            what = "seconds > 0" if strict else "seconds >= 0 (0: no health probes)"
            return f"{key}{name}={value!r}: expected {what}"
    if c.max_backoff_s < c.backoff_s:
        return (
            f"{key}max_backoff_s={c.max_backoff_s!r} < {key}backoff_s={c.backoff_s!r}: "
            "expected max_backoff_s >= backoff_s (the cap on the doubled delay)"
        )
    return None


def validate_supervision(c: SupervisionConfig, key: str = "rl.supervision") -> None:
    """Each value's range; an error names the key, the value and what is accepted."""
    problem = policy_problem(c, f"{key}.")
    if problem is not None:
        raise ConfigError(problem)
