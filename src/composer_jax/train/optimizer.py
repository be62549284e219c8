"""AdamW with warmup-cosine / warmup-stable-decay schedules, clipping and weight-decay masks."""

from __future__ import annotations

from typing import Any

import jax
import optax

from composer_jax.config import LoraConfig, ModelConfig, OptimizerConfig
from composer_jax.model.lora import adapter_specs
from composer_jax.model.params import gradient_free_mask, weight_decay_mask
from composer_jax.specs import is_spec


def learning_rate_schedule(cfg: OptimizerConfig, total_steps: int) -> optax.Schedule:
    warmup = min(cfg.warmup_steps, max(total_steps - 1, 0))
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "constant":
        return optax.join_schedules(
            [optax.linear_schedule(0.0, cfg.lr, warmup), optax.constant_schedule(cfg.lr)], [warmup]
        )
    if cfg.schedule == "warmup_cosine":
        return optax.warmup_cosine_decay_schedule(0.0, cfg.lr, warmup, max(total_steps, warmup + 1), end_value=floor)
    decay = cfg.decay_steps or max(1, total_steps // 10)
    stable = max(total_steps - warmup - decay, 0)
    return optax.join_schedules(
        [
            optax.linear_schedule(0.0, cfg.lr, warmup),
            optax.constant_schedule(cfg.lr),
            optax.linear_schedule(cfg.lr, floor, decay),
        ],
        [warmup, warmup + stable],
    )


def make_optimizer(
    cfg: OptimizerConfig, total_steps: int, model: ModelConfig, lora: LoraConfig | None = None
) -> optax.GradientTransformation:
    """Clipping, then AdamW with weight decay where the model says so (`weight_decay_mask`), then
    zero updates for the leaves the model moves by other rules (`gradient_free_mask`: the router
    biases, which have no gradient anyway). Every param-shaped tree in the state (AdamW's moments)
    has the parameters' exact tree structure, so `train.state` shards it like the parameters.

    lora (enabled): the trained tree is the adapters (`model.lora.adapter_specs`), every leaf a
    matrix factor with weight decay and a gradient; the moments then hold the adapters only."""
    schedule = learning_rate_schedule(cfg, total_steps)
    if lora is not None and lora.enabled:
        decay: Any = jax.tree.map(lambda _: True, adapter_specs(model, lora), is_leaf=is_spec)
        frozen: Any = jax.tree.map(lambda _: False, decay)
    else:
        decay, frozen = weight_decay_mask(model), gradient_free_mask(model)
    chain = []
    if cfg.clip_norm > 0:
        chain.append(optax.clip_by_global_norm(cfg.clip_norm))
    chain.append(optax.adamw(schedule, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay))
    chain.append(optax.masked(optax.set_to_zero(), frozen))
    return optax.chain(*chain)
