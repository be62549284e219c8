"""The weight-sync store lives in `composer_jax.checkpoint.weight_sync` (a storage format that the serve
side, below `rl/`, reads too); this module keeps the RL-facing import path."""

from composer_jax.checkpoint.weight_sync import (
    PublishInfo,
    WeightPublisher,
    WeightSubscriber,
    WeightSyncError,
    tree_sha256,
)

__all__ = ["PublishInfo", "WeightPublisher", "WeightSubscriber", "WeightSyncError", "tree_sha256"]
