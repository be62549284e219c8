"""Which kind of checkpoint directory a path is: the one decision every reader of one makes.

Its two readers: `hf/init_from.py` (`train.init_from` for pretrain and SFT, the RL restore through
`rl/restore.py`, `model.from`) and `inference/server/policy.py` (`serve`, `sample`, `eval
--checkpoint` and `/admin/load_weights`). Three kinds, by their files:

    run     a training run's checkpoints: a directory of numbered step directories (e.g.
            runs/tiny/stage2/checkpoints), one step's directory (orbax's commit marker or
            train_state/), the run directory holding checkpoints/ (read there), or an object-store
            URL (gs://...), taken as a run's checkpoint directory
    hf      a Hugging Face checkpoint: config.json and its weights, model.safetensors or
            model.safetensors.index.json with its shards
    orbax   what `composer-jax convert --to-orbax` writes (params/ + model.yaml)

A Hugging Face directory needs its weights: both readers read tensors (serving loads them, and the
model config counts the MTP modules the tensors hold), so config.json alone is refused with a
CheckpointError naming the missing files. Any other directory is refused with a ConfigError naming
the key it was given as, the path, what it holds and the accepted kinds.

It sits in `hf/` because that is the lowest layer that sees all three formats (the safetensors file
names here, the run checkpoints of `checkpoint/` below).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from composer_jax.checkpoint.validate import COMMIT_MARKER, CheckpointError
from composer_jax.config import ConfigError
from composer_jax.hf import safetensors_io as st

KINDS = ("run", "hf", "orbax")

ACCEPTED = (
    "accepted: a training run's checkpoint directory (numbered step directories, e.g. runs/tiny/stage2/"
    "checkpoints, one step's directory, or the run directory holding checkpoints/; gs:// URLs too), a Hugging "
    f"Face checkpoint directory (config.json + {st.SINGLE_NAME} or {st.INDEX_NAME} with its shards) or a "
    "`composer-jax convert --to-orbax` directory (params/ + model.yaml)"
)


@dataclasses.dataclass(frozen=True)
class CheckpointDir:
    """kind: one of KINDS; path: as given; where: the directory to read (a run directory's
    checkpoints/, else `path`)."""

    kind: str
    path: str
    where: str


def _is_run_checkpoint(p: Path) -> bool:
    if (p / COMMIT_MARKER).exists() or (p / "train_state").is_dir():
        return True
    return any(c.is_dir() and c.name.isdigit() for c in p.iterdir())


def _has_hf_weights(p: Path) -> bool:
    return (p / st.SINGLE_NAME).is_file() or (p / st.INDEX_NAME).is_file()


def detect(path: str | os.PathLike, key: str = "checkpoint") -> CheckpointDir:
    """The kind of the checkpoint directory `path` (module docstring); `key` is what the user gave
    it as (`train.init_from`, `--checkpoint`), named by the errors."""
    given = str(path)
    if "://" in given:
        return CheckpointDir("run", given, given)
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"{key}={given!r}: not a directory; {ACCEPTED}")
    if (p / "config.json").is_file() and _has_hf_weights(p):
        return CheckpointDir("hf", given, given)
    if (p / "model.yaml").is_file() and (p / "params").is_dir():
        return CheckpointDir("orbax", given, given)
    if _is_run_checkpoint(p):
        return CheckpointDir("run", given, given)
    if (p / "checkpoints").is_dir() and _is_run_checkpoint(p / "checkpoints"):
        return CheckpointDir("run", given, str(p / "checkpoints"))
    if (p / "config.json").is_file():
        raise CheckpointError(
            f"{key}={given!r}: a Hugging Face checkpoint directory without its weights: it holds config.json but "
            f"neither {st.SINGLE_NAME} nor {st.INDEX_NAME} (with its shards); {ACCEPTED}",
            path=given,
        )
    listed = sorted(c.name for c in p.iterdir())[:12]
    raise ConfigError(f"{key}={given!r}: none of the three kinds of checkpoint (it holds {listed}); {ACCEPTED}")
