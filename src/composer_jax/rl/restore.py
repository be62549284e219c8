"""Where a learner starts: its run's latest checkpoint, else given parameters, else
`train.init_from`, else a fresh model."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from composer_jax.checkpoint.manager import TrainCheckpointer, restore_params_only
from composer_jax.config import Config
from composer_jax.model.params import abstract_params
from composer_jax.rl.rollout.ledger import GroupsState
from composer_jax.rl.rollout.queue import DoneIds
from composer_jax.train.loop import STAGE_CHANGEABLE
from composer_jax.train.state import abstract_train_state, init_train_state


@dataclasses.dataclass
class Start:
    """The train state to start from, its step (= policy version), the next group id of the task
    stream and the group ids already done; `resumed`: from the run's own checkpoint."""

    state: Any
    step: int = 0
    next_group: int = 0
    done: DoneIds = dataclasses.field(default_factory=DoneIds)
    resumed: bool = False


def restore_or_init(
    cfg: Config,
    mesh,
    rules,
    checkpointer: TrainCheckpointer,
    *,
    run_config: dict,
    init_params: Any = None,
    echo: Callable[[str], None] = print,
) -> Start:
    """The run's latest checkpoint (train state, step, next group, done ids) when it has one, else
    a train state over `init_params` (e.g. from a notebook), else over `train.init_from`'s
    parameters, else a freshly initialised model."""
    if checkpointer.latest_step() is not None:
        restored = checkpointer.restore(abstract_train_state(cfg, mesh, rules), config=run_config)
        groups = GroupsState.from_data_state(restored.data_state)
        return Start(restored.train_state, restored.step, groups.next_group, groups.done, resumed=True)
    if init_params is not None:
        return Start(init_train_state(cfg, mesh, rules, init_params))
    if cfg.train.init_from:
        params = restore_params_only(
            cfg.train.init_from,
            abstract_params(cfg.model, mesh, rules),
            config=run_config,
            allow_config_changes=STAGE_CHANGEABLE,
        )
        echo(f"[rl] initialised from {cfg.train.init_from}")
        return Start(init_train_state(cfg, mesh, rules, params))
    return Start(init_train_state(cfg, mesh, rules))
