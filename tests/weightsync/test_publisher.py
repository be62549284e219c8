"""The learner's publisher (`rl/publish.py` `store_publisher`) in one process: every version read
back bit-exactly as the host copy `published_copy` makes, the checkpoint's own version not written
twice on a resume, and a store with a lost lineage rewound."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from composer_jax.config import ConfigError
from composer_jax.weightsync.publisher import published_copy, store_publisher
from composer_jax.weightsync.subscriber import WeightSubscriber


def _params(seed: int) -> dict:
    k1, k2 = jax.random.split(jax.random.key(seed))
    return {"w": jax.random.normal(k1, (8, 16)), "layer": {"b": jax.random.normal(k2, (16,)), "n": jnp.arange(4)}}


def _same(a: dict, b: dict) -> None:
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)
    assert jax.tree.map(lambda x: np.asarray(x).dtype, a) == jax.tree.map(lambda x: np.asarray(x).dtype, b)


@pytest.mark.parametrize("dtype", ["", "bfloat16"])
def test_every_version_reads_back_as_the_host_copy(tmp_path, dtype):
    url, lines = f"file://{tmp_path}/store", []
    publish = store_publisher(url, resumed=False, start=0, dtype=dtype, echo=lines.append)
    for v in range(3):
        publish(_params(v), v)
    sub = WeightSubscriber(url)
    assert sub.versions() == [0, 1, 2]
    for v in range(3):
        _same(sub.read(v)[1], published_copy(_params(v), dtype))


def test_a_resume_skips_its_own_version_and_rewinds_the_lost_ones(tmp_path):
    url, lines = f"file://{tmp_path}/store", []
    publish = store_publisher(url, resumed=False, start=0, dtype="", echo=lines.append)
    for v in range(4):
        publish(_params(v), v)
    # resumed from the checkpoint of step 1: versions 2, 3 were the lost run's
    publish = store_publisher(url, resumed=True, start=1, dtype="", echo=lines.append)
    assert WeightSubscriber(url).versions() == [0, 1]
    assert any("rewound to version 1" in line for line in lines)
    publish(_params(7), 1)  # the checkpoint's own weights: already there, not written again
    publish(_params(12), 2)
    sub = WeightSubscriber(url)
    _same(sub.read(1)[1], published_copy(_params(1), ""))
    _same(sub.read(2)[1], published_copy(_params(12), ""))
    with pytest.raises(ConfigError, match="that are not this run's"):
        store_publisher(url, resumed=False, start=0, dtype="", echo=lines.append)


def test_a_store_url_tensorstore_cannot_open_is_the_users_config_error():
    with pytest.raises(ConfigError, match=r"rl.weight_store='nosuch://x': cannot open weight-sync url"):
        store_publisher("nosuch://x", resumed=False, start=0, dtype="", echo=print)
