"""Data shards: the global batch as `data.shards` independent streams, whichever hosts read them.

Shard s of n is the stream `make_train_iterator(process_index=s, process_count=n)` builds: documents
s::n of every source, packed on their own, batch_size/n rows per batch. Row block s of every global
batch (rows [s*batch/n, (s+1)*batch/n)) comes from shard s, and a host reads the shards whose rows
its devices hold. So the batches - and a run's losses - are the same on one host as on n/k hosts
(tested: tests/train/test_multiprocess.py), and a checkpoint's data state (one grain state per
shard, gathered from every host) resumes on any host count that divides the shard count.
`data.shards: 0` is one shard per process (each host reads disjoint documents, as before).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from composer_jax.config.data import DataConfig, DataConfigError
from composer_jax.data.pipeline import (
    STATE_VERSION,
    DataIterator,
    make_eval_batches,
    make_train_iterator,
    padding_rows,
)
from composer_jax.formats.tokenizer import load_tokenizer

SHARDED_STATE_VERSION = 1


def shard_count(data_cfg: DataConfig, process_count: int) -> int:
    """data.shards, or one per process when 0; checked to split evenly over the processes."""
    n = data_cfg.shards or process_count
    if n % process_count:
        raise DataConfigError(
            f"data.shards={data_cfg.shards} cannot be split over {process_count} processes; "
            f"accepted: a multiple of {process_count}, or 0 (one shard per process)"
        )
    return n


def host_shards(row_start: int, row_stop: int, global_batch: int, shards: int) -> range:
    """The shards whose rows [row_start, row_stop) of a [global_batch, ...] batch this host holds."""
    if global_batch % shards:
        raise DataConfigError(
            f"train.batch_size={global_batch} is not a multiple of data.shards={shards}; "
            f"accepted: a shard count dividing the batch size"
        )
    per = global_batch // shards
    if row_start % per or row_stop % per:
        raise DataConfigError(
            f"this host holds batch rows [{row_start}, {row_stop}), which do not fall on the "
            f"{shards} data shards' boundaries (every {per} rows); accepted: data.shards a multiple "
            "of the number of hosts holding distinct batch rows"
        )
    return range(row_start // per, row_stop // per)


class ShardedIterator:
    """A host's training stream: its shards' batches concatenated in shard order, each array
    [len(shards) * batch/shards, seq_len].

    `get_state()` holds one grain state per shard of this host ({"shards": {"s": state}});
    `merge_states` joins the hosts' states into the run's, and `set_state` takes this host's
    shards from a merged state (a single-shard run also takes a plain `DataIterator` state).
    """

    def __init__(self, iterators: dict[int, DataIterator], shard_count: int):
        self._its = iterators
        self.shard_count = shard_count

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        parts = [next(it) for it in self._its.values()]
        if len(parts) == 1:
            return parts[0]
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def get_state(self) -> dict[str, Any]:
        return {
            "version": SHARDED_STATE_VERSION,
            "shard_count": self.shard_count,
            "shards": {str(s): it.get_state() for s, it in self._its.items()},
        }

    def set_state(self, state: dict[str, Any]) -> None:
        if self.shard_count == 1 and isinstance(state, dict) and state.get("version") == STATE_VERSION:
            if "grain" in state:  # a plain one-stream state (checkpoints from before data shards)
                state = {"version": SHARDED_STATE_VERSION, "shard_count": 1, "shards": {"0": state}}
        if not isinstance(state, dict) or "shards" not in state:
            raise DataConfigError(
                f"data state must come from ShardedIterator.get_state (version {SHARDED_STATE_VERSION}); "
                f"got {str(state)[:200]}"
            )
        if state.get("shard_count") != self.shard_count:
            raise DataConfigError(
                f"cannot resume the data stream: the checkpoint has {state.get('shard_count')} data shards, "
                f"this run {self.shard_count}; accepted: the same data.shards (set it explicitly to move "
                "a run to another host count)"
            )
        missing = [s for s in self._its if str(s) not in state["shards"]]
        if missing:
            raise DataConfigError(
                f"the saved data state has no state for shards {missing} (it holds {sorted(state['shards'])})"
            )
        for s, it in self._its.items():
            it.set_state(state["shards"][str(s)])


def merge_states(states: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The run's data state from every host's `ShardedIterator.get_state()` (disjoint shards)."""
    merged: dict[str, Any] = {}
    for st in states:
        overlap = set(merged) & set(st["shards"])
        if overlap:
            raise ValueError(f"two hosts hold data shards {sorted(overlap)}")
        merged.update(st["shards"])
    counts = {st["shard_count"] for st in states}
    if len(counts) != 1:
        raise ValueError(f"hosts disagree on the shard count: {sorted(counts)}")
    return {
        "version": SHARDED_STATE_VERSION,
        "shard_count": counts.pop(),
        "shards": dict(sorted(merged.items(), key=lambda kv: int(kv[0]))),
    }


def make_host_iterator(
    data_cfg: DataConfig, *, seq_len: int, global_batch: int, seed: int, shards: range, shard_count: int
) -> ShardedIterator:
    """The training stream of the shards `shards` (of `shard_count`) of a [global_batch, seq_len] batch."""
    per = global_batch // shard_count
    its = {
        s: make_train_iterator(
            data_cfg, seq_len=seq_len, batch_size=per, seed=seed, process_index=s, process_count=shard_count
        )
        for s in shards
    }
    return ShardedIterator(its, shard_count)


def host_eval_batches(
    data_cfg: DataConfig, *, seq_len: int, global_batch: int, num_batches: int, shards: range, shard_count: int
) -> list[list[dict[str, np.ndarray]]]:
    """Each of this host's shards' held-out batches ([global_batch/shard_count, seq_len] each);
    shards may hold different numbers of batches: `stack_eval_batches` evens them out."""
    per = global_batch // shard_count
    return [
        make_eval_batches(
            data_cfg,
            seq_len=seq_len,
            batch_size=per,
            num_batches=num_batches,
            process_index=s,
            process_count=shard_count,
        )
        for s in shards
    ]


def stack_eval_batches(
    per_shard: list[list[dict[str, np.ndarray]]], num_batches: int, tokenizer: str
) -> list[dict[str, np.ndarray]]:
    """This host's eval batches: batch i concatenates every shard's batch i, a shard that has run
    out giving padding rows (loss_mask 0), so that every host runs the same `num_batches` (the
    most any shard of the run has) and the eval step's collectives line up."""
    pad_id = load_tokenizer(tokenizer).pad_id
    out = []
    for i in range(num_batches):
        parts = []
        for batches in per_shard:
            ref = batches[0]["tokens"]
            parts.append(batches[i] if i < len(batches) else padding_rows(ref.shape[0], ref.shape[1], pad_id))
        out.append({k: np.concatenate([p[k] for p in parts]) for k in parts[0]})
    return out


__all__ = [
    "ShardedIterator",
    "host_eval_batches",
    "host_shards",
    "make_host_iterator",
    "merge_states",
    "shard_count",
    "stack_eval_batches",
]
