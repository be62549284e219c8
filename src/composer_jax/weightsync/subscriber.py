"""Policy versions from the RL weight-sync store, in the served parameter tree.

`StoreWeights` keeps one `WeightSubscriber` per store URL (so a replica that follows a run of
deltas reads each delta once, not its base again) and turns a stored version into the served tree:
same paths and shapes as the served parameters, cast to their dtypes and put on their shardings
(the store holds plain arrays; the trainer may publish float32 or bfloat16). The version numbers a
replica serves are the published ones. Used by `/admin/load_weights` with `"source": "weight_store"`
and by `composer-jax serve --weights-from URL`, which polls the store (`inference/server/app.py`).
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import jax
import numpy as np

from composer_jax.weightsync.store import WeightSubscriber, WeightSyncError


@dataclasses.dataclass(frozen=True)
class StoreVersion:
    """A version read from a store: `version` may be older than the one asked for when the store
    held a bad copy (`fallback` says why; None when the asked-for version read)."""

    url: str
    version: int
    params: Any
    fallback: str | None


def _paths(tree: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(tree, dict):
        out: dict[str, Any] = {}
        for k in sorted(tree):
            out.update(_paths(tree[k], f"{prefix}/{k}" if prefix else str(k)))
        return out
    return {prefix: tree}


class StoreWeights:
    """Reads versions from weight-sync stores by URL into the served tree (module docstring)."""

    def __init__(self, retry_delay_s: float = 0.2) -> None:
        self._subs: dict[str, WeightSubscriber] = {}
        self._lock = threading.Lock()
        self.retry_delay_s = retry_delay_s

    def subscriber(self, url: str) -> WeightSubscriber:
        """The subscriber of `url` (opened once; WeightSyncError for a URL tensorstore cannot open)."""
        with self._lock:
            if url not in self._subs:
                self._subs[url] = WeightSubscriber(url, retry_delay_s=self.retry_delay_s)
            return self._subs[url]

    def latest(self, url: str) -> int | None:
        return self.subscriber(url).latest_version()

    def read(self, url: str, version: int | None, served: Any) -> StoreVersion:
        """`version` (None: the latest) of the store at `url`, as arrays shaped, typed and sharded
        like `served`; WeightSyncError when the store lacks it or its tree differs from `served`."""
        sub = self.subscriber(url)
        got, tree = sub.read(version)
        return StoreVersion(url, got, to_served(tree, served, f"version {got} of {url}"), sub.last_fallback)


def to_served(tree: Any, served: Any, what: str) -> Any:
    """`tree` (nested dicts of numpy arrays) in the structure, dtypes and shardings of `served`."""
    new, old = _paths(tree), _paths(served)
    if new.keys() != old.keys():
        missing, extra = sorted(old.keys() - new.keys()), sorted(new.keys() - old.keys())
        raise WeightSyncError(
            f"{what} is not the served model's parameter tree: missing {missing[:5]}, unexpected {extra[:5]}"
        )
    for path, a in new.items():
        if tuple(np.shape(a)) != tuple(old[path].shape):
            raise WeightSyncError(
                f"{what}: leaf {path!r} has shape {list(np.shape(a))}, the served model's is {list(old[path].shape)}"
            )
    leaves = {p: jax.device_put(np.asarray(a).astype(old[p].dtype), old[p].sharding) for p, a in new.items()}

    def rebuild(node: Any, prefix: str) -> Any:
        if isinstance(node, dict):
            return {k: rebuild(v, f"{prefix}/{k}" if prefix else str(k)) for k, v in node.items()}
        return leaves[prefix]

    return rebuild(served, "")
