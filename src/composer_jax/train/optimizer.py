"""AdamW with warmup-cosine / warmup-stable-decay schedules, clipping and weight-decay masks."""
from __future__ import annotations

import jax
import optax

from composer_jax.config import OptimizerConfig

def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return optax.join_schedules([optax.linear_schedule(0.0, cfg.lr, warmup), optax.constant_schedule(cfg.lr)], [warmup])
    if cfg.schedule == "warmup_cosine":
        return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(total_steps, warmup + 1), end_value=floor)
    decay = cfg.decay_steps or max(1, total_steps // 10)
    stable = max(total_steps - warmup - decay, 0)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, cfg.lr, warmup), optax.constant_schedule(cfg.lr),
         optax.linear_schedule(cfg.lr, floor, decay)], [warmup, warmup + stable])


def decay_mask(params) -> dict:
    """True for leaves that receive weight decay: matrices, but not norms (stacked norms are 2-D, so
    this goes by name), the router bias, or the embedding."""
    def keep(path, leaf) -> bool:
        names = [str(getattr(k, "key", k)) for k in path]
        return (leaf.ndim >= 2 and names[0] != "embed" and "norm" not in names[-1]
                and names[-1] != "router_bias")
    return jax.tree_util.tree_map_with_path(keep, params)


def frozen_mask(params) -> dict:
    """True for leaves the optimiser must not touch: the router score-correction bias is moved by
    the aux-loss-free rule (`moe.router_bias_update`), not by gradients (it has none)."""
    return jax.tree_util.tree_map_with_path(
        lambda path, _: str(getattr(path[-1], "key", "")) == "router_bias", params)


def make_optimizer(cfg: OptimizerConfig, total_steps: int) -> optax.GradientTransformation:
    schedule = learning_rate_schedule(cfg, total_steps)
    chain = []
    if cfg.clip_norm > 0:
        chain.append(optax.clip_by_global_norm(cfg.clip_norm))
    chain.append(optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay,
                             mask=decay_mask))
    tx = optax.chain(*chain)
    return optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()},
                                 lambda p: jax.tree.map(lambda f: "frozen" if f else "train", frozen_mask(p)))
