"""`CheckpointConfig`: where training checkpoints go, how often, and which are kept.

Kept free of JAX and orbax imports so that `composer_jax.config` can attach it to the top-level
`Config` (as `checkpoint`) without pulling in the checkpointing stack.
"""

from __future__ import annotations

import dataclasses

from composer_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    """Training-checkpoint settings (YAML section `checkpoint`).

    Retention keeps the union of two sets: the last `keep_last` checkpoints (crash recovery) and
    every checkpoint whose step is a multiple of `keep_every` (evaluation and stage hand-off points;
    kept forever). See docs/checkpoints.md for a worked example.
    """

    # Root directory; each saved step is a sub-directory named by its step number. A local path or
    # any URL orbax/tensorstore can write (gs://...). Empty = checkpointing off.
    directory: str = ""
    # Save when step % save_every == 0 (`TrainCheckpointer.save(..., force=True)` saves regardless,
    # e.g. at the end of a stage or on preemption).
    save_every: int = 1000
    # Keep the newest N checkpoints; 0 keeps all of them.
    keep_last: int = 3
    # Also keep every checkpoint whose step is a multiple of M, forever; 0 = off.
    keep_every: int = 0
    # Write in a background thread: `save` returns once device arrays are copied to host memory and
    # training continues while the files are written; `wait()` blocks until they are committed.
    async_save: bool = True
    # On resume, a corrupt or unreadable newest checkpoint falls back to the previous good one
    # (with a warning) instead of stopping the run.
    fallback: bool = True
    # After such a fallback, move the bad newer step directories to `<directory>/quarantine/` so
    # training can write those step numbers again and a later resume does not retry them.
    quarantine_bad: bool = True
    # Sections of the saved run config that must equal the current one on resume ...
    check_config_sections: tuple[str, ...] = ("model",)
    # ... except for these dotted keys (or key prefixes), e.g. "model.rope_scaling" or
    # "model.max_position_embeddings" when a stage extends the context length.
    allow_config_changes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # YAML gives lists; keep the dataclass hashable and immutable.
        for name in ("check_config_sections", "allow_config_changes"):
            value = getattr(self, name)
            if isinstance(value, str):
                value = (value,)
            object.__setattr__(self, name, tuple(value))
        validate_checkpoint_config(self)

    @property
    def enabled(self) -> bool:
        return bool(self.directory)


def validate_checkpoint_config(c: CheckpointConfig) -> None:
    """Raise `ConfigError` naming the key, the value and what is accepted."""
    if not isinstance(c.directory, str):
        raise ConfigError(f"checkpoint.directory={c.directory!r}: expected a path string")
    for key, low in (("save_every", 1), ("keep_last", 0), ("keep_every", 0)):
        value = getattr(c, key)
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            accepted = "a positive integer" if low == 1 else "an integer >= 0 (0 = off / keep all)"
            raise ConfigError(f"checkpoint.{key}={value!r}: expected {accepted}")
    if c.keep_every and c.keep_every % c.save_every:
        raise ConfigError(
            f"checkpoint.keep_every={c.keep_every} is not a multiple of checkpoint.save_every="
            f"{c.save_every}, so no periodic save would land on a kept step; use a multiple of "
            f"{c.save_every} (e.g. {c.save_every * max(1, c.keep_every // c.save_every)}) or 0"
        )
    for key in ("check_config_sections", "allow_config_changes"):
        bad = [k for k in getattr(c, key) if not isinstance(k, str) or not k]
        if bad:
            raise ConfigError(f"checkpoint.{key} holds {bad!r}; expected non-empty dotted key strings")
