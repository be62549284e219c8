"""The training section: one stage's batch, schedule, optimiser, loss weights and outputs."""

from __future__ import annotations

import dataclasses
from typing import Literal

from composer_jax.config.lora import LoraConfig, validate_lora
from composer_jax.config.ray import TrainerRayConfig, validate_placement
from composer_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    """AdamW (optax) with a learning-rate schedule and global-norm clipping."""

    lr: float = 3e-4
    # warmup_cosine: linear warmup then cosine to min_lr_ratio * lr at train.steps;
    # wsd: warmup-stable-decay (MiniCPM): warmup, constant, then a linear decay over decay_steps
    schedule: Literal["warmup_cosine", "wsd", "constant"] = "warmup_cosine"
    warmup_steps: int = 100
    decay_steps: int = 0  # wsd only: length of the final decay (0 = 10% of train.steps)
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1  # not applied to norms, biases, router bias, or embeddings
    clip_norm: float = 1.0  # 0 disables clipping


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training stage (continued pretraining or SFT)."""

    stage: str = "stage1"
    seq_len: int = 128
    batch_size: int = 8  # global sequences per optimiser step
    micro_batches: int = 1  # gradient accumulation: batch_size is split into this many
    steps: int = 100
    seed: int = 0
    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    z_loss: float = 1e-4  # weight of log(Z)^2 (PaLM) keeping the softmax normaliser near 1
    mtp_weight: float = 0.3
    # ce: MTP depth k trained on the token k+1 ahead; self_distill: KL from the main model's
    # (stopped) next-token distribution at that position, as Composer 2 trains its MTP layers
    mtp_loss: Literal["ce", "self_distill"] = "ce"
    seq_balance_loss: float = 0.0  # DeepSeek-V3 complementary sequence-wise balance loss weight
    router_bias_update: bool = True  # aux-loss-free bias update after every step
    eval_every: int = 50
    eval_batches: int = 4
    log_every: int = 10
    out_dir: str = "runs/default"
    init_from: str = ""  # previous stage's checkpoint directory (params only, fresh optimiser)
    skip_nonfinite: bool = True  # a NaN/Inf loss or gradient skips the update and is reported
    peak_tflops: float = 0.0  # per-device peak for MFU; 0 = measure a float32 matmul at start-up
    # the accelerator the stage is sized for (a key of `composer-jax inspect`'s device table, e.g.
    # h200); `inspect` checks the stage's memory against it by default. "" = none named
    device: str = ""
    tensorboard: bool = True
    # where the trainer runs: "local", the process that was started (with --coordinator or
    # --distributed, one of several started by hand or by a cluster's scheduler); "ray", one
    # trainer actor per host placed by Ray as train.ray says (`--placement ray`; config/ray.py,
    # runtime/ray_trainer.py)
    placement: str = "local"
    ray: TrainerRayConfig = dataclasses.field(default_factory=TrainerRayConfig)
    # low-rank adapters over a frozen base (config/lora.py; rank 0 = off, full fine-tuning)
    lora: LoraConfig = dataclasses.field(default_factory=LoraConfig)


def validate_train(t: TrainConfig) -> None:
    """The train section's own checks (seq_len against the mesh: `config/run.py`)."""
    for key in ("seq_len", "batch_size", "micro_batches", "steps", "log_every", "eval_every"):
        if getattr(t, key) < 1:
            raise ConfigError(f"train.{key}={getattr(t, key)} must be a positive integer")
    if t.batch_size % t.micro_batches:
        raise ConfigError(
            f"train.batch_size={t.batch_size} is not divisible by train.micro_batches="
            f"{t.micro_batches}; accepted micro_batches: "
            f"{[d for d in range(1, t.batch_size + 1) if t.batch_size % d == 0]}"
        )
    validate_placement(t.placement, "train.placement")
    if t.optimizer.lr <= 0 or t.optimizer.warmup_steps < 0:
        raise ConfigError(
            f"train.optimizer.lr={t.optimizer.lr} must be > 0 and warmup_steps={t.optimizer.warmup_steps} >= 0"
        )
    validate_lora(t.lora)
