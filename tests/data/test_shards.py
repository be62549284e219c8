"""Data shards (data/shards.py): a host's batch is its shards' batches in shard order, the state of
every host merges into one that resumes any host layout over the same shards."""

import numpy as np
import pytest
from support.datahelpers import numbered_docs, write_jsonl

from composer_jax.config.data import DataConfig, DataConfigError, SourceConfig
from composer_jax.data.pipeline import make_train_iterator
from composer_jax.data.shards import (
    ShardedIterator,
    host_eval_batches,
    host_shards,
    make_host_iterator,
    merge_states,
    shard_count,
    stack_eval_batches,
)


@pytest.fixture
def cfg(tmp_path, tok_dir) -> DataConfig:
    path = write_jsonl(tmp_path / "a.jsonl", [{"text": d} for d in numbered_docs(40)])
    return DataConfig(
        sources=(SourceConfig(type="jsonl", path=str(path)),),
        tokenizer=tok_dir,
        eval_fraction=0.2,
        shards=4,
        shuffle_window=2,
    )


def test_shard_assignment_and_errors(cfg):
    assert shard_count(cfg, 2) == 4 and shard_count(DataConfig(), 3) == 3  # 0 = one per process
    with pytest.raises(DataConfigError, match=r"data.shards=4 cannot be split over 3 processes"):
        shard_count(cfg, 3)
    assert host_shards(4, 8, 8, 4) == range(2, 4)  # rows 4..8 of 8, 2 rows per shard
    with pytest.raises(DataConfigError, match=r"rows \[3, 8\)"):
        host_shards(3, 8, 8, 4)
    with pytest.raises(DataConfigError, match=r"train.batch_size=6 is not a multiple of data.shards=4"):
        host_shards(0, 6, 6, 4)


def test_hosts_batches_are_the_one_host_batch_split_by_rows(cfg):
    one = make_host_iterator(cfg, seq_len=32, global_batch=4, seed=3, shards=range(2), shard_count=2)
    hosts = [
        make_host_iterator(cfg, seq_len=32, global_batch=4, seed=3, shards=range(i, i + 1), shard_count=2)
        for i in range(2)
    ]
    # shard s is the plain stream of host s of 2 (documents s::2)
    plain = make_train_iterator(cfg, seq_len=32, batch_size=2, seed=3, process_index=1, process_count=2)
    for i in range(3):
        b = next(one)
        parts = [next(h) for h in hosts]
        for k in b:
            assert np.array_equal(b[k], np.concatenate([p[k] for p in parts]))
        if i == 0:
            assert np.array_equal(parts[1]["tokens"], next(plain)["tokens"])


def test_merged_states_resume_another_host_layout(cfg):
    hosts = [
        make_host_iterator(cfg, seq_len=32, global_batch=4, seed=0, shards=range(i, i + 1), shard_count=2)
        for i in range(2)
    ]
    for _ in range(2):
        for h in hosts:
            next(h)
    state = merge_states([h.get_state() for h in hosts])
    assert state["shard_count"] == 2 and list(state["shards"]) == ["0", "1"]
    want = np.concatenate([next(h)["tokens"] for h in hosts])
    one = make_host_iterator(cfg, seq_len=32, global_batch=4, seed=0, shards=range(2), shard_count=2)
    one.set_state(state)  # two hosts' checkpoint, resumed on one host
    assert np.array_equal(next(one)["tokens"], want)
    with pytest.raises(ValueError, match=r"two hosts hold data shards \['0'\]"):
        merge_states([hosts[0].get_state(), hosts[0].get_state()])
    with pytest.raises(DataConfigError, match="the checkpoint has 2 data shards, this run 1"):
        ShardedIterator({}, 1).set_state(state)


def test_a_single_shard_takes_a_plain_iterator_state(cfg):
    plain = make_train_iterator(cfg, seq_len=32, batch_size=2, seed=0)
    next(plain)
    sharded = ShardedIterator({0: make_train_iterator(cfg, seq_len=32, batch_size=2, seed=0)}, 1)
    sharded.set_state(plain.get_state())  # a checkpoint from before data shards
    assert np.array_equal(next(sharded)["tokens"], next(plain)["tokens"])


def test_eval_batches_are_padded_to_the_longest_shard(cfg, tok):
    per_shard = host_eval_batches(cfg, seq_len=32, global_batch=4, num_batches=50, shards=range(4), shard_count=4)
    counts = [len(b) for b in per_shard]
    n = max(counts)
    stacked = stack_eval_batches(per_shard, n, cfg.tokenizer)
    assert len(stacked) == n and all(b["tokens"].shape == (4, 32) for b in stacked)
    for s, batches in enumerate(per_shard):
        for i in range(n):
            rows = {k: v[s : s + 1] for k, v in stacked[i].items()}
            if i < len(batches):
                assert np.array_equal(rows["tokens"], batches[i]["tokens"])
            else:  # a shard that ran out gives padding rows: no loss, no tokens counted
                assert not rows["loss_mask"].any() and not rows["segment_ids"].any()
                assert (rows["tokens"] == tok.pad_id).all()
