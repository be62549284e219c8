"""Checks run before a checkpoint is restored, and the errors they raise.

orbax reports a damaged or mismatched checkpoint as a bare `ValueError` carrying a tensorstore spec
of several hundred lines, or not at all (a step directory without its commit marker is still listed
by `CheckpointManager.all_steps` on a local filesystem). These checks turn each case into an error
that names the checkpoint path, the step and what is wrong, and sort them into *corrupt* (files
missing or unreadable: an older step may still be good) and *mismatch* (the checkpoint does not fit
what the caller asked for).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import jax
import numpy as np
from etils import epath

from composer_jax.errors import UserError

# orbax writes this file into a step directory as the last act of a save, with both of its
# atomicity protocols (rename of a temporary directory on POSIX, in-place commit file on object
# stores), so a step directory without it is an interrupted save.
COMMIT_MARKER = "commit_success.txt"
# Per-item tree metadata (paths, shapes, dtypes) written by orbax's PyTree handlers.
TREE_METADATA = "_METADATA"

_MAX_LISTED = 8  # paths listed per kind of difference in an error message


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be used (missing, corrupt, or not this run's: the user's, not a bug).
    `path` and `step` name it (either may be None)."""

    def __init__(self, message: str, *, path: Any = None, step: int | None = None):
        super().__init__(message)
        self.path = None if path is None else str(path)
        self.step = step


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No checkpoint (or not the requested step) exists under the directory."""


class CheckpointCorruptError(CheckpointError):
    """Files of the checkpoint are missing, truncated or unreadable, or it was never committed."""


class CheckpointMismatchError(CheckpointError):
    """The saved tree differs from the requested one (leaf paths, shapes or dtypes)."""


class ConfigMismatchError(CheckpointError):
    """The run config saved with the checkpoint differs from the current one in checked keys."""


class NoGoodCheckpointError(CheckpointError):
    """Every candidate step failed; `attempts` holds (step, error) for each, newest first."""

    def __init__(self, message: str, *, path: Any, attempts: Sequence[tuple[int, CheckpointError]]):
        super().__init__(message, path=path, step=None)
        self.attempts = list(attempts)


def describe(path: Any, step: int) -> str:
    return f"checkpoint {str(path)!r} (step {step})"


def short_reason(error: BaseException, limit: int = 300) -> str:
    """First line of an orbax/tensorstore error, without the embedded tensorstore spec."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = text.split(" [tensorstore_spec=")[0]
    return text if len(text) <= limit else text[:limit] + "..."


def check_committed(step_dir: epath.Path, step: int, items: Iterable[str]) -> None:
    """The step directory exists, carries orbax's commit marker and holds each item directory."""
    if not step_dir.exists():
        raise CheckpointNotFoundError(
            f"{describe(step_dir, step)}: the directory does not exist", path=step_dir, step=step
        )
    if not (step_dir / COMMIT_MARKER).exists():
        raise CheckpointCorruptError(
            f"{describe(step_dir, step)}: no {COMMIT_MARKER} commit marker, so the save that wrote "
            f"it never finished (a crash or preemption mid-write); it cannot be trusted",
            path=step_dir,
            step=step,
        )
    for item in items:
        if not (step_dir / item).is_dir():
            present = sorted(p.name for p in step_dir.iterdir())
            raise CheckpointCorruptError(
                f"{describe(step_dir, step)}: item directory {item!r} is missing (found {present})",
                path=step_dir,
                step=step,
            )


# --------------------------------------------------------------------------------------------------
# Trees: the saved structure against the requested one
# --------------------------------------------------------------------------------------------------


def key_name(k: Any) -> str:
    """One pytree key as text. orbax stores attributes, named-tuple fields and tuple positions as
    dict keys and list indices, so `.opt_state[0].mu` and `['opt_state'][0]['mu']` must agree."""
    for attr in ("name", "key", "idx"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def leaf_path(path: Sequence[Any]) -> str:
    return "/".join(key_name(k) for k in path)


def is_prng_key(leaf: Any) -> bool:
    return jax.dtypes.issubdtype(getattr(leaf, "dtype", None), jax.dtypes.prng_key)


def flat_abstract(tree: Any) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """leaf path -> (shape, dtype) as it is stored. Typed PRNG keys are stored by orbax as their
    key data (uint32[..., 2] for threefry) and re-wrapped on restore, so compare that form."""
    out = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if is_prng_key(leaf):
            leaf = jax.eval_shape(jax.random.key_data, jax.ShapeDtypeStruct(leaf.shape, leaf.dtype))
        out[leaf_path(path)] = (tuple(np.shape(leaf)), np.dtype(leaf.dtype))
    return out


def flat_saved(tree_metadata: Any) -> dict[str, tuple[tuple[int, ...], np.dtype | None]]:
    """leaf path -> (shape, dtype) from orbax's `item_metadata(...)` tree."""
    out = {}
    for path, meta in jax.tree_util.tree_flatten_with_path(tree_metadata)[0]:
        shape = getattr(meta, "shape", None)
        dtype = getattr(meta, "dtype", None)
        out[leaf_path(path)] = (
            tuple(shape) if shape is not None else (),
            np.dtype(dtype) if dtype is not None else None,
        )
    return out


def _listed(items: Sequence[str]) -> str:
    shown = ", ".join(items[:_MAX_LISTED])
    return shown + (f", ... ({len(items) - _MAX_LISTED} more)" if len(items) > _MAX_LISTED else "")


def compare_trees(
    saved: Mapping[str, tuple], wanted: Mapping[str, tuple], *, path: Any, step: int, what: str = "train state"
) -> None:
    """Raise `CheckpointMismatchError` listing leaves missing, unexpected, or of another shape/dtype."""
    missing = sorted(set(wanted) - set(saved))
    unexpected = sorted(set(saved) - set(wanted))
    changed = []
    for p in sorted(set(wanted) & set(saved)):
        (s_shape, s_dtype), (w_shape, w_dtype) = saved[p], wanted[p]
        if s_shape != w_shape:
            changed.append(f"{p}: saved shape {s_shape}, requested {w_shape}")
        elif s_dtype is not None and s_dtype != w_dtype:
            # orbax would silently cast; a changed dtype almost always means a changed config
            changed.append(f"{p}: saved dtype {s_dtype}, requested {w_dtype}")
    if not (missing or unexpected or changed):
        return
    parts = []
    if missing:
        parts.append(f"{len(missing)} requested leaves are not in the checkpoint: {_listed(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} saved leaves are not requested: {_listed(unexpected)}")
    if changed:
        parts.append(f"{len(changed)} leaves differ: {_listed(changed)}")
    raise CheckpointMismatchError(
        f"{describe(path, step)}: the saved {what} does not match the requested abstract tree; " + "; ".join(parts),
        path=path,
        step=step,
    )


def leaves_without_sharding(tree: Any) -> list[str]:
    """Paths of abstract leaves that carry no sharding (orbax would restore them as host numpy)."""
    return [
        leaf_path(p)
        for p, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]
        if getattr(leaf, "sharding", None) is None
    ]


# --------------------------------------------------------------------------------------------------
# Run configs: the saved one against the current one
# --------------------------------------------------------------------------------------------------


_ABSENT = "<absent>"


def jsonable(value: Any, what: str) -> Any:
    """`value` as it will read back from JSON (tuples become lists); a clear error if it cannot."""
    try:
        return json.loads(json.dumps(value, allow_nan=True))
    except (TypeError, ValueError) as e:
        raise TypeError(f"{what} must be JSON-serialisable (dicts, lists, str, numbers, bools, None): {e}") from None


def flatten_config(tree: Any, prefix: str) -> dict[str, Any]:
    if isinstance(tree, Mapping):
        out: dict[str, Any] = {}
        for k, v in tree.items():
            out.update(flatten_config(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix: tree}


def key_allowed(key: str, allowed: Sequence[str]) -> bool:
    """True if dotted `key` equals an allowed key or lies under an allowed prefix."""
    return any(key == a or key.startswith(a + ".") for a in allowed)


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def config_differences(
    saved: Mapping[str, Any], current: Mapping[str, Any], sections: Sequence[str], allowed: Sequence[str] = ()
) -> list[tuple[str, Any, Any]]:
    """(dotted key, saved value, current value) for each checked key that differs and is not allowed."""
    saved, current = jsonable(saved, "saved config"), jsonable(current, "config")
    diffs = []
    for section in sections:
        s = flatten_config(saved.get(section, {}), section)
        c = flatten_config(current.get(section, {}), section)
        for key in sorted(set(s) | set(c)):
            sv, cv = s.get(key, _ABSENT), c.get(key, _ABSENT)
            if not _equal(sv, cv) and not key_allowed(key, allowed):
                diffs.append((key, sv, cv))
    return diffs


def raise_on_config_differences(diffs: Sequence[tuple[str, Any, Any]], *, path: Any, step: int) -> None:
    if not diffs:
        return
    listed = "; ".join(f"{k}: saved {sv!r}, now {cv!r}" for k, sv, cv in diffs[:_MAX_LISTED])
    more = f"; ... ({len(diffs) - _MAX_LISTED} more)" if len(diffs) > _MAX_LISTED else ""
    keys = ", ".join(repr(k) for k, _, _ in diffs)
    raise ConfigMismatchError(
        f"{describe(path, step)} was saved with a different config: {listed}{more}. If these "
        f"changes are intended (e.g. a new training stage), allow them with "
        f"allow_config_changes=[{keys}] (checkpoint.allow_config_changes in YAML)",
        path=path,
        step=step,
    )
