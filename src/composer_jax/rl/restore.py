"""Where a learner starts: its run's latest checkpoint, else given parameters, else
`train.init_from` (a run's checkpoint, a Hugging Face or a `convert --to-orbax` directory:
hf/init_from.py), else a fresh model."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax

from composer_jax.checkpoint.manager import TrainCheckpointer
from composer_jax.config import Config
from composer_jax.hf.init_from import describe_init, fresh_record, load_init_params
from composer_jax.model.params import init_params as init_params_fn
from composer_jax.rl.rollout.ledger import GroupsState
from composer_jax.rl.rollout.queue import DoneIds
from composer_jax.train.state import abstract_train_state, frozen_base, init_train_state


@dataclasses.dataclass
class Start:
    """The train state to start from, its step (= policy version), the next group id of the task
    stream and the group ids already done; `resumed`: from the run's own checkpoint; `init`: where
    the weights came from (hf/init_from.py's record)."""

    state: Any
    step: int = 0
    next_group: int = 0
    done: DoneIds = dataclasses.field(default_factory=DoneIds)
    resumed: bool = False
    init: dict[str, Any] = dataclasses.field(default_factory=dict)


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
        init = {"kind": "resume", "path": str(checkpointer.step_dir(restored.step)), "step": restored.step}
        state = restored.train_state
        if cfg.train.lora.enabled:  # the checkpoint holds the adapters: the frozen base is loaded again
            state = dataclasses.replace(state, frozen=_lora_base(cfg, mesh, rules, run_config, init_params))
        return Start(state, restored.step, groups.next_group, groups.done, resumed=True, init=init)
    if init_params is not None:
        return Start(init_train_state(cfg, mesh, rules, init_params), init={"kind": "given", "path": None})
    if cfg.train.init_from:
        params, record = load_init_params(cfg, mesh, rules, run_config)
        echo(f"[rl] initialised from {describe_init(record)}")
        return Start(init_train_state(cfg, mesh, rules, params), init=record)
    return Start(init_train_state(cfg, mesh, rules), init=fresh_record(cfg))


def _lora_base(cfg: Config, mesh, rules, run_config: dict, init_params: Any) -> Any:
    """The frozen base of a resumed `train.lora` run, from where the run first took it: the given
    parameters, `train.init_from`, or the fresh model of `train.seed` (deterministic), quantised
    again as `train.lora.base_format` says (deterministic too: the same codes as the first start)."""
    if init_params is not None:
        params = init_params
    elif cfg.train.init_from:
        params = load_init_params(cfg, mesh, rules, run_config)[0]
    else:
        params = init_params_fn(cfg.model, jax.random.key(cfg.train.seed), mesh, rules)
    return frozen_base(cfg, params, mesh, rules)
