"""A `train.lora` RL run's checkpoint made without a train step: the learner's fresh state
(`rl/restore.py`: the base of train.seed, fresh adapters) with every adapter leaf moved by random
values (fresh B is zero: the adapted model would equal the base), saved as the learner saves it
(`TrainState.checkpointed`: adapters + their optimiser state, the run config beside)."""

from __future__ import annotations

from pathlib import Path

import jax

from composer_jax.checkpoint.manager import TrainCheckpointer
from composer_jax.config import Config, load_config, to_dict
from composer_jax.rl.restore import restore_or_init
from composer_jax.sharding import ShardingRules, make_mesh
from composer_jax.train.loop import run_checkpoint_config
from composer_jax.train.state import TrainState

CONFIG = "tests/rl/fixtures/rl_pick.yaml"  # relative to the repository root: chdir there first
LORA = ["train.lora.rank=4", "train.lora.alpha=8", "train.lora.targets=[attention]"]


def lora_config(out_dir: Path, extra: list[str] | tuple[str, ...] = ()) -> Config:
    overrides = [f"train.out_dir={out_dir}", "rl.eval_tasks=[]", "checkpoint.save_every=1", *LORA, *extra]
    return load_config(CONFIG, overrides)


def save_lora_run(
    out_dir: Path, step: int = 3, extra: list[str] | tuple[str, ...] = (), *, move: bool = True
) -> tuple[Config, TrainState]:
    """(the run's config, the saved state with its frozen base) of a LoRA run checkpointed at `step`
    under `out_dir`/checkpoints; `move=False` keeps the fresh adapters (A random, B zero: one
    compile fewer)."""
    cfg = lora_config(out_dir, extra)
    mesh, rules = make_mesh(cfg.mesh), ShardingRules.create(cfg.sharding_rules)
    with TrainCheckpointer(run_checkpoint_config(cfg)) as checkpointer:
        state = restore_or_init(cfg, mesh, rules, checkpointer, run_config=to_dict(cfg), echo=lambda _: None).state
        if move:
            state.params = _moved(state.params)
        checkpointer.save(step, state.checkpointed(), config=to_dict(cfg), force=True)
        checkpointer.wait()
    return cfg, state


@jax.jit
def _moved(adapters):
    """Every leaf plus 0.05 x normal noise (one compiled function: eager ops compile per shape)."""
    leaves, treedef = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(7), len(leaves))
    return jax.tree.unflatten(
        treedef, [x + 0.05 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)]
    )
