"""The learner's weight publisher: every new policy version to `rl.weight_store`, from one process
(gathered to the host) or from every process of a multi-host trainer (each its own shards)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from composer_jax.config import ConfigError
from composer_jax.multihost import ProcessZeroWork
from composer_jax.weightsync.sharded import open_publisher
from composer_jax.weightsync.store import WeightSubscriber, open_store, rewind_store


def published_copy(params: Any, dtype: str) -> Any:
    """The host copy published to the weight store: floating leaves cast to `dtype` ("" = as is).
    With several processes every array is gathered to every process (a collective; the trainer
    publishes per shard instead, `store_publisher`). The single-writer reference of
    tests/support/publish_worker.py."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        host = multihost_utils.process_allgather(params, tiled=True)
    else:
        host = jax.device_get(params)
    if not dtype:
        return host
    return jax.tree.map(lambda x: x.astype(dtype) if np.issubdtype(x.dtype, np.floating) else x, host)


def store_publisher(
    store_url: str, *, resumed: bool, start: int, dtype: str, echo: Callable[[str], None]
) -> Callable[[Any, int], None]:
    """`publish(params, version)`, which every process of the trainer calls for every version (a
    collective), through `open_publisher`: one process copies the tree to the host and writes it
    with a `WeightPublisher`; several each write their own shards (`ShardedWeightPublisher`: no
    host gathers the model). On a resume the store is rewound to the checkpoint's version `start`
    first."""
    if not store_url:
        return lambda params, version: None
    # the store's versions before this run: every process reads them (a publish is a collective,
    # which all must skip or all take)
    stored = set(WeightSubscriber(store_url).versions())
    if stored and (not resumed or (start not in stored and max(stored) > start)):
        raise ConfigError(
            f"rl.weight_store={store_url!r} holds versions {sorted(stored)[:5]}..{max(stored)} that are not this "
            f"run's ({'a fresh run' if not resumed else f'resumed at step {start}, a version it lacks'}); "
            "give an empty store (or remove it)"
        )
    # a trainer stopped after its last checkpoint: the versions it published since are a lost
    # lineage (its weights died with it); this run publishes those numbers anew. Process 0 rewinds,
    # the others wait for it (and stop with its error if the rewind fails).
    work = ProcessZeroWork()

    def rewind() -> None:
        gone = rewind_store(open_store(store_url), start)
        echo(f"[rl] weight store rewound to version {start}: versions {gone} were of the lost run")

    if stored and max(stored) > start:
        work.call("rewinding the weight store", rewind)
    work.share()
    publisher = open_publisher(store_url)  # one process: whole leaves; several: each its own shards

    def publish(params: Any, version: int) -> None:
        if version == start and start in stored:  # the checkpoint's own weights, published before it
            return
        publisher.publish(params, version, dtype=dtype)

    return publish
