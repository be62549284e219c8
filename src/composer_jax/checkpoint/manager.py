"""Training checkpoints: save and resume the full train state with orbax.

`TrainCheckpointer` wraps an orbax `CheckpointManager`. Each saved step is one directory holding
three orbax items, written together and committed together::

    <directory>/<step>/train_state/   params, optimiser state, step, rng key (StandardSave pytree)
    <directory>/<step>/data_state/    the data iterator's state (JSON), when given
    <directory>/<step>/config/        the run config (JSON), checked on resume

Restoring takes an abstract train state (ShapeDtypeStructs with shardings): arrays are read
straight into those shardings, so a run saved on one mesh resumes on another. A damaged newest
checkpoint falls back to the previous good one. See docs/checkpoints.md.

`restore_params_only` starts a new stage from a previous stage's checkpoint: parameters only, the
optimiser starts fresh.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import orbax.checkpoint as ocp
from etils import epath

from composer_jax.checkpoint.validate import (
    COMMIT_MARKER,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
    NoGoodCheckpointError,
    check_committed,
    compare_trees,
    config_differences,
    describe,
    flat_abstract,
    flat_saved,
    jsonable,
    leaves_without_sharding,
    raise_on_config_differences,
    short_reason,
)
from composer_jax.config.checkpoint import CheckpointConfig

logger = logging.getLogger(__name__)

STATE_ITEM = "train_state"
DATA_ITEM = "data_state"
CONFIG_ITEM = "config"
# not "metrics": orbax reserves that item name for its own best-checkpoint tracking, and writes
# nothing there unless a best_fn is configured
METRICS_ITEM = "train_metrics"
QUARANTINE_DIR = "quarantine"
FORMAT_VERSION = 1


class Restored(NamedTuple):
    """What `TrainCheckpointer.restore` returns; unpacks as (train_state, data_state, config, step)."""

    train_state: Any
    data_state: dict | None
    config: dict
    step: int


def _root_path(directory: str | os.PathLike) -> epath.Path:
    text = os.fspath(directory)
    # orbax wants absolute paths; object-store URLs (gs://, s3://) are already absolute
    return epath.Path(text if "://" in text else os.path.abspath(text))


def _preservation_policy(c: CheckpointConfig) -> Any:
    """keep_last N or'ed with keep_every M (orbax keeps a step if any policy keeps it)."""
    cm = ocp.checkpoint_managers
    policies = [cm.LatestN(n=c.keep_last or None)]  # n=None keeps all
    if c.keep_every:
        # exact_interval: keep steps with step % M == 0, not "at least M apart" (which would drift
        # after a resume from a fallback step)
        policies.append(cm.EveryNSteps(interval_steps=c.keep_every, exact_interval=True))
    return policies[0] if len(policies) == 1 else cm.AnyPreservationPolicy(policies=policies)


def _item_handlers(state_handler: Any) -> dict[str, Any]:
    # Registered up front (rather than inferred from the first save/restore call) so that metadata
    # can be read from a fresh manager before anything has been saved or restored through it.
    return {
        STATE_ITEM: state_handler,
        DATA_ITEM: ocp.JsonCheckpointHandler(),
        CONFIG_ITEM: ocp.JsonCheckpointHandler(),
        METRICS_ITEM: ocp.JsonCheckpointHandler(),
    }


def _step_dir(manager: ocp.CheckpointManager, step: int) -> epath.Path:
    # Default step naming (no prefix, no zero padding): the directory is the step number.
    return epath.Path(manager.directory) / str(step)


def _read_config(manager: ocp.CheckpointManager, step: int, step_dir: epath.Path) -> dict:
    try:
        return manager.restore(step, args=ocp.args.Composite(**{CONFIG_ITEM: ocp.args.JsonRestore()}))[CONFIG_ITEM]
    except Exception as e:  # orbax raises ValueError/FileNotFoundError/JSON errors alike
        raise CheckpointCorruptError(
            f"{describe(step_dir, step)}: the saved run config cannot be read: {short_reason(e)}",
            path=step_dir,
            step=step,
        ) from e


def _read_tree_metadata(manager: ocp.CheckpointManager, step: int, step_dir: epath.Path) -> Any:
    error: Exception | None = None
    try:
        meta = manager.item_metadata(step)[STATE_ITEM]
    except Exception as e:
        meta, error = None, e
    if meta is None:
        reason = short_reason(error) if error is not None else "the tree metadata file is missing"
        raise CheckpointCorruptError(
            f"{describe(step_dir, step)}: cannot read the {STATE_ITEM} structure: {reason}", path=step_dir, step=step
        ) from error
    return getattr(meta, "tree", meta)


class TrainCheckpointer:
    """Asynchronous, retained, resharding checkpoints of a training run.

    Usage::

        with TrainCheckpointer(cfg.checkpoint) as ckpt:
            if ckpt.latest_step() is not None:
                state, data_state, _, step = ckpt.restore(abstract_state, config=to_dict(cfg))
            for step in ...:
                state = train_step(state, batch)
                ckpt.save(step, state, data_state=it.get_state(), config=to_dict(cfg))

    Every process of a multi-host job constructs one and calls `save`/`restore` at the same steps.
    """

    def __init__(self, config: CheckpointConfig):
        if not config.enabled:
            raise ValueError(
                "checkpoint.directory is empty: set it to a path (or gs:// URL) to "
                "save checkpoints, e.g. checkpoint.directory=runs/my_run/checkpoints"
            )
        self.config = config
        self.directory = _root_path(config.directory)
        cm = ocp.checkpoint_managers
        options = ocp.CheckpointManagerOptions(
            # step % save_every == 0, or a preemption notice (jax's preemption sync manager, when a
            # multi-host job has one); not orbax's default extra save of a run's first step
            save_decision_policy=cm.AnySavePolicy(
                [cm.FixedIntervalPolicy(config.save_every), cm.PreemptionCheckpointingPolicy()]
            ),
            preservation_policy=_preservation_policy(config),
            enable_async_checkpointing=config.async_save,
            create=True,
            # a crash mid-save leaves a `<step>.orbax-checkpoint-tmp-*` directory, never a listed step
            cleanup_tmp_directories=True,
        )
        self._manager = ocp.CheckpointManager(
            self.directory, options=options, item_handlers=_item_handlers(ocp.StandardCheckpointHandler())
        )

    # -- bookkeeping ----------------------------------------------------------------------------

    def all_steps(self) -> list[int]:
        """Saved steps, ascending (including an asynchronous save still being written)."""
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def step_dir(self, step: int) -> epath.Path:
        return _step_dir(self._manager, step)

    def read_metrics(self, step: int) -> dict[str, float] | None:
        """The `metrics` saved with `step`, or None if none were given."""
        self.wait()  # an asynchronous save is still under a temporary name
        if not (self.step_dir(step) / METRICS_ITEM).is_dir():
            return None
        return self._manager.restore(step, args=ocp.args.Composite(**{METRICS_ITEM: ocp.args.JsonRestore()}))[
            METRICS_ITEM
        ]

    def wait(self) -> None:
        """Block until every pending asynchronous save is committed (raises if one failed)."""
        self._manager.wait_until_finished()

    def close(self) -> None:
        """Wait for pending saves and release orbax's background threads."""
        self._manager.close()

    def __enter__(self) -> TrainCheckpointer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- save -----------------------------------------------------------------------------------

    def due(self, step: int, *, force: bool = False) -> bool:
        """Whether `save(step, ..., force=force)` would write (to gather what it needs only then)."""
        step = int(step)
        return step not in self._manager.all_steps() and (force or self._manager.should_save(step))

    def save(
        self,
        step: int,
        train_state: Any,
        *,
        data_state: Mapping[str, Any] | None = None,
        config: Mapping[str, Any],
        metrics: Mapping[str, float] | None = None,
        force: bool = False,
    ) -> bool:
        """Save `train_state` (any pytree of jax arrays, typed PRNG keys included) at `step`.

        Saves when `step % save_every == 0` or `force`; returns whether a save was started. With
        `async_save` the call returns once the arrays are copied off the devices, so the caller
        may donate or overwrite them; files are written in the background (`wait()` to finish).
        `data_state` (the data iterator's state) and `config` (the run config) must be
        JSON-serialisable; `metrics` (scalars, e.g. loss) are stored with the step (`read_metrics`).
        """
        step = int(step)
        # Fail here, in the caller's thread, rather than later in orbax's background writer.
        config = jsonable(dict(config), "config")
        if data_state is not None:
            data_state = jsonable(dict(data_state), "data_state")
        if metrics is not None:
            metrics = jsonable({k: float(v) for k, v in metrics.items()}, "metrics")
        if step in self._manager.all_steps():
            logger.info("checkpoint step %d already exists in %s; not saving it again", step, self.directory)
            return False
        if not force and not self._manager.should_save(step):
            latest = self.latest_step()
            if latest is not None and step <= latest:
                logger.warning(
                    "not saving step %d: %s already holds the later step %d (orbax only appends); "
                    "resume from the latest step, or move the later steps away",
                    step,
                    self.directory,
                    latest,
                )
            return False
        items = {STATE_ITEM: ocp.args.StandardSave(train_state), CONFIG_ITEM: ocp.args.JsonSave(config)}
        if data_state is not None:
            items[DATA_ITEM] = ocp.args.JsonSave(data_state)
        if metrics is not None:
            items[METRICS_ITEM] = ocp.args.JsonSave(metrics)
        return self._manager.save(
            step,
            args=ocp.args.Composite(**items),
            force=True,  # the interval decision was taken above
            custom_metadata={"composer_jax_checkpoint_format": FORMAT_VERSION},
        )

    # -- restore --------------------------------------------------------------------------------

    def restore(
        self,
        abstract_state: Any,
        step: int | None = None,
        *,
        config: Mapping[str, Any] | None = None,
        allow_config_changes: Sequence[str] | None = None,
        fallback: bool | None = None,
    ) -> Restored:
        """Restore the train state, data state and run config of `step` (default: the latest).

        abstract_state: the train state's tree of `jax.ShapeDtypeStruct`s, each with the sharding
            to restore onto (any mesh shape: arrays are resharded as they are read).
        config: the current run config; its `check_config_sections` must equal the saved ones
            except for `allow_config_changes` (default: from CheckpointConfig). None skips the check.
        fallback: on a corrupt or mismatched step, warn and try the next older one (default:
            `CheckpointConfig.fallback`). Steps skipped this way are moved to `quarantine/` when
            `quarantine_bad` is set, so that training can save those step numbers again.

        Raises CheckpointNotFoundError (nothing saved / no such step), ConfigMismatchError (never
        falls back: all steps of a run share its config), CheckpointCorruptError or
        CheckpointMismatchError (without fallback), NoGoodCheckpointError (every step failed).
        """
        unsharded = leaves_without_sharding(abstract_state)
        if unsharded:
            raise ValueError(
                f"abstract_state leaves without a sharding: {unsharded[:8]}; give every "
                f"jax.ShapeDtypeStruct a sharding (e.g. NamedSharding(mesh, P()) for replicated)"
            )
        self.wait()  # the step to read may still be being written
        steps = self.all_steps()
        if not steps:
            raise CheckpointNotFoundError(f"no checkpoints in {str(self.directory)!r}", path=self.directory)
        if step is not None and step not in steps:
            raise CheckpointNotFoundError(
                f"no checkpoint for step {step} in {str(self.directory)!r}; saved steps: {steps}",
                path=self.directory,
                step=step,
            )
        fallback = self.config.fallback if fallback is None else fallback
        allowed = self.config.allow_config_changes if allow_config_changes is None else tuple(allow_config_changes)
        candidates = [s for s in reversed(steps) if step is None or s <= step]
        if not fallback:
            candidates = candidates[:1]

        attempts: list[tuple[int, CheckpointError]] = []
        for s in candidates:
            try:
                restored = self._restore_step(s, abstract_state, config, allowed)
            except (CheckpointCorruptError, CheckpointMismatchError, CheckpointNotFoundError) as e:
                if not fallback:
                    raise
                attempts.append((s, e))
                logger.warning("%s; falling back to an older checkpoint", e)
                continue
            if attempts:
                logger.warning(
                    "resumed from step %d of %s after skipping bad steps %s",
                    s,
                    self.directory,
                    [a for a, _ in attempts],
                )
                if self.config.quarantine_bad:
                    self._quarantine([a for a, _ in attempts])
            return restored
        tried = "\n".join(f"  step {s}: {e}" for s, e in attempts)
        raise NoGoodCheckpointError(
            f"no usable checkpoint in {str(self.directory)!r}; tried, newest first:\n{tried}",
            path=self.directory,
            attempts=attempts,
        )

    def _restore_step(
        self, step: int, abstract_state: Any, config: Mapping[str, Any] | None, allowed: Sequence[str]
    ) -> Restored:
        step_dir = self.step_dir(step)
        check_committed(step_dir, step, (STATE_ITEM, CONFIG_ITEM))
        saved_config = _read_config(self._manager, step, step_dir)
        if config is not None:
            diffs = config_differences(saved_config, config, self.config.check_config_sections, allowed)
            raise_on_config_differences(diffs, path=step_dir, step=step)
        saved = flat_saved(_read_tree_metadata(self._manager, step, step_dir))
        compare_trees(saved, flat_abstract(abstract_state), path=step_dir, step=step)
        items = {STATE_ITEM: ocp.args.StandardRestore(abstract_state)}
        has_data = (step_dir / DATA_ITEM).is_dir()
        if has_data:
            items[DATA_ITEM] = ocp.args.JsonRestore()
        try:
            out = self._manager.restore(step, args=ocp.args.Composite(**items))
        except Exception as e:  # tensorstore: NOT_FOUND / OUT_OF_RANGE / DATA_LOSS ... as ValueError
            raise CheckpointCorruptError(
                f"{describe(step_dir, step)}: reading {sorted(items)} failed: {short_reason(e)}",
                path=step_dir,
                step=step,
            ) from e
        return Restored(out[STATE_ITEM], out[DATA_ITEM] if has_data else None, saved_config, step)

    def _quarantine(self, steps: Sequence[int]) -> None:
        """Move bad step directories aside (renamed, never deleted: they may be worth a look)."""
        if jax.process_index() == 0:
            target = self.directory / QUARANTINE_DIR
            target.mkdir(parents=True, exist_ok=True)
            for s in steps:
                src = self.step_dir(s)
                if not src.exists():
                    continue
                dst = target / str(s)
                if dst.exists():
                    dst = target / f"{s}.{time.time_ns()}"
                try:
                    src.rename(dst)
                    logger.warning("moved bad checkpoint %s to %s", src, dst)
                except OSError as e:  # e.g. object stores without directory rename
                    logger.warning(
                        "could not move bad checkpoint %s aside (%s); later saves of "
                        "step %d will be skipped until it is removed",
                        src,
                        e,
                        s,
                    )
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices(f"composer_jax_ckpt_quarantine_{min(steps)}")
        self._manager.reload()


def _root_and_step(path_or_dir: str | os.PathLike, step: int | None) -> tuple[epath.Path, int | None]:
    """A checkpoint root or one step's directory -> (root, step or None for the latest)."""
    path = _root_path(path_or_dir)
    if (path / COMMIT_MARKER).exists() or (path / STATE_ITEM).is_dir():
        if step is not None and str(step) != path.name:
            raise ValueError(f"{str(path)!r} is the directory of step {path.name}, but step={step} was asked for")
        root, step = path.parent, int(path.name)
    else:
        root = path
    if not root.is_dir():
        raise CheckpointNotFoundError(f"checkpoint directory {str(root)!r} does not exist", path=root)
    return root, step


def _committed_step(manager: Any, root: Any, step: int | None) -> tuple[int, Any]:
    """(step, its directory): the latest step of `manager`, or `step`, checked to be fully written."""
    steps = sorted(manager.all_steps())
    if not steps:
        raise CheckpointNotFoundError(f"no checkpoints in {str(root)!r}", path=root)
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise CheckpointNotFoundError(
            f"no checkpoint for step {step} in {str(root)!r}; saved steps: {steps}", path=root, step=step
        )
    step_dir = _step_dir(manager, step)
    check_committed(step_dir, step, (STATE_ITEM, CONFIG_ITEM))
    return step, step_dir


@contextlib.contextmanager
def _read_only(path_or_dir: str | os.PathLike, step: int | None) -> Iterator[tuple[Any, int, Any]]:
    """A read-only manager of the checkpoint root `path_or_dir` names, the committed step asked for
    (`_root_and_step`: the latest, `step`, or the step directory given) and that step's directory."""
    root, step = _root_and_step(path_or_dir, step)
    options = ocp.CheckpointManagerOptions(read_only=True, create=False)
    with ocp.CheckpointManager(
        root, options=options, item_handlers=_item_handlers(ocp.PyTreeCheckpointHandler())
    ) as manager:
        step, step_dir = _committed_step(manager, root, step)
        yield manager, step, step_dir


def read_run_config(path_or_dir: str | os.PathLike, step: int | None = None) -> tuple[dict, int]:
    """(the run config saved with a step, that step): the latest step of a checkpoint root, or
    `step`, or the step whose directory is given. For loading a checkpoint's parameters without
    knowing its config (the inference server), before `restore_params_only`."""
    with _read_only(path_or_dir, step) as (manager, step, step_dir):
        return _read_config(manager, step, step_dir), step


def saved_leaves(path_or_dir: str | os.PathLike, step: int | None = None) -> dict[str, tuple[tuple[int, ...], Any]]:
    """leaf path ("params/moe_layers/attn/q_a", "opt_state/...") -> (shape, dtype) of the train
    state saved at a step (the latest of a checkpoint root, or `step`, or the step whose directory
    is given), read from its metadata alone: what a checkpoint holds, without reading an array."""
    with _read_only(path_or_dir, step) as (manager, step, step_dir):
        return flat_saved(_read_tree_metadata(manager, step, step_dir))


def restore_params_only(
    path_or_dir: str | os.PathLike,
    abstract_params: Any,
    step: int | None = None,
    *,
    params_key: str = "params",
    config: Mapping[str, Any] | None = None,
    allow_config_changes: Sequence[str] = (),
    check_config_sections: Sequence[str] = ("model",),
) -> Any:
    """The parameters of a saved train state, for starting a new stage (fresh optimiser state).

    path_or_dir: a checkpoint root directory (the latest step, or `step`, is used) or one step's
        directory (`<root>/<step>`).
    abstract_params: the parameter tree of `jax.ShapeDtypeStruct`s with target shardings, e.g.
        `composer_jax.model.params.abstract_params(cfg.model, mesh)`; any mesh shape.
    params_key: where the parameters sit in the saved train state (`train_state[params_key]`).
    config / allow_config_changes: as for `TrainCheckpointer.restore`; a new stage typically allows
        e.g. "model.rope_scaling" and "model.max_position_embeddings" to change.

    Only the parameter arrays are read (orbax partial restore): the optimiser moments, often twice
    the size of the parameters, are never loaded.
    """
    root, step = _root_and_step(path_or_dir, step)
    unsharded = leaves_without_sharding(abstract_params)
    if unsharded:
        raise ValueError(f"abstract_params leaves without a sharding: {unsharded[:8]}")
    # PyTreeCheckpointHandler reads StandardSave's format and, unlike StandardRestore, can restore a
    # sub-tree (partial_restore). A read-only manager never deletes or creates anything.
    options = ocp.CheckpointManagerOptions(read_only=True, create=False)
    with ocp.CheckpointManager(
        root, options=options, item_handlers=_item_handlers(ocp.PyTreeCheckpointHandler())
    ) as manager:
        step, step_dir = _committed_step(manager, root, step)
        if config is not None:
            diffs = config_differences(
                _read_config(manager, step, step_dir), config, check_config_sections, allow_config_changes
            )
            raise_on_config_differences(diffs, path=step_dir, step=step)
        prefix = params_key + "/"
        saved = {
            k[len(prefix) :]: v
            for k, v in flat_saved(_read_tree_metadata(manager, step, step_dir)).items()
            if k.startswith(prefix)
        }
        if not saved:
            raise CheckpointMismatchError(
                f"{describe(step_dir, step)}: the saved {STATE_ITEM} has no "
                f"{params_key!r} sub-tree; pass params_key=...",
                path=step_dir,
                step=step,
            )
        compare_trees(saved, flat_abstract(abstract_params), path=step_dir, step=step, what="parameters")
        item = {params_key: abstract_params}
        args = ocp.args.PyTreeRestore(
            item=item, restore_args=ocp.checkpoint_utils.construct_restore_args(item), partial_restore=True
        )
        try:
            out = manager.restore(step, args=ocp.args.Composite(**{STATE_ITEM: args}))
        except Exception as e:
            raise CheckpointCorruptError(
                f"{describe(step_dir, step)}: reading the parameters failed: {short_reason(e)}",
                path=step_dir,
                step=step,
            ) from e
    return out[STATE_ITEM][params_key]
