"""Packing, mixture, host sharding, train/eval split, chunking and exact resume of the grain pipeline."""

import collections
import dataclasses
import json

import numpy as np
import pytest
from support.datahelpers import numbered_docs, segments, write_jsonl

from composer_jax.config.data import DataConfig, DataConfigError, SourceConfig
from composer_jax.data.pipeline import make_eval_batches, make_train_iterator, train_rows
from composer_jax.data.sources import content_hash_fraction


def _cfg(tok_dir, *sources, **kw) -> DataConfig:
    return DataConfig(sources=tuple(sources), tokenizer=tok_dir, **kw)


def _jsonl_source(tmp_path, name, docs, **kw) -> SourceConfig:
    return SourceConfig(
        type="jsonl", path=str(write_jsonl(tmp_path / f"{name}.jsonl", [{"text": d} for d in docs])), **kw
    )


def _rows(cfg, tok, seq_len, **kw):
    return list(train_rows(cfg, tok, seq_len=seq_len, seed=0, num_epochs=1, **kw))


def check_row_invariants(row, tok):
    """The batch contract, checked row by row against a direct reading of its definition."""
    tokens, seg, pos, mask = row["tokens"], row["segment_ids"], row["positions"], row["loss_mask"]
    assert tokens.dtype == seg.dtype == pos.dtype == np.int32 and mask.dtype == np.float32
    ids = seg[seg > 0]
    # segments are 1, 2, ... in order of appearance, contiguous, padding (0) only at the end
    assert list(dict.fromkeys(ids.tolist())) == list(range(1, int(seg.max(initial=0)) + 1))
    assert np.all(seg[len(ids) :] == 0) and np.all(tokens[seg == 0] == tok.pad_id) and np.all(pos[seg == 0] == 0)
    for s in np.unique(ids):
        assert pos[seg == s].tolist() == list(range(int((seg == s).sum())))
    # pretrain: every non-padding token except each segment's first is a target
    assert np.array_equal(mask, ((seg > 0) & (pos > 0)).astype(np.float32))


def test_packing_keeps_every_token_exactly_once(tmp_path, tok, tok_dir):
    docs = numbered_docs(40) + ["x" * 30 + " long " * 60]  # one document longer than the row
    cfg = _cfg(tok_dir, _jsonl_source(tmp_path, "a", docs), eval_fraction=0.0, num_packing_bins=3)
    seq_len = 32
    rows = _rows(cfg, tok, seq_len)
    for r in rows:
        check_row_invariants(r, tok)
    expected = collections.Counter()
    for d in docs:
        expected.update([tok.bos_id, *tok.encode(d), tok.eos_id])
    got = collections.Counter()
    for r in rows:
        got.update(r["tokens"][r["segment_ids"] > 0].tolist())
    assert got == expected
    # the long document: BOS + its tokens + EOS cut into consecutive chunks of seq_len, each its own segment
    long_ids = [tok.bos_id, *tok.encode(docs[-1]), tok.eos_id]
    chunks = [long_ids[a : a + seq_len] for a in range(0, len(long_ids), seq_len)]
    found = [r["tokens"][r["segment_ids"] == s].tolist() for r in rows for s in np.unique(r["segment_ids"]) if s]
    assert all(c in found for c in chunks) and len(chunks) >= 3


def test_max_chunks_per_document_drops_the_tail(tmp_path, tok, tok_dir):
    cfg = _cfg(tok_dir, _jsonl_source(tmp_path, "a", ["word " * 200]), eval_fraction=0.0, max_chunks_per_document=2)
    rows = _rows(cfg, tok, 16)
    assert sum(int((r["segment_ids"] > 0).sum()) for r in rows) == 32


def test_batches_have_the_contract_shapes(tmp_path, tok, tok_dir):
    cfg = _cfg(tok_dir, _jsonl_source(tmp_path, "a", numbered_docs(30)))
    it = make_train_iterator(cfg, seq_len=48, batch_size=3, seed=1)
    for _ in range(12):  # several epochs of this small corpus
        b = next(it)
        assert set(b) == {"tokens", "segment_ids", "positions", "loss_mask", "source_ids"}
        assert all(v.shape == (3, 48) for v in b.values())
        for r in range(3):
            check_row_invariants({k: v[r] for k, v in b.items()}, tok)


def test_mixture_follows_weights(tmp_path, tok, tok_dir):
    a = _jsonl_source(tmp_path, "a", numbered_docs(50, "alpha"), weight=3.0)
    b = _jsonl_source(tmp_path, "b", numbered_docs(50, "beta"), weight=1.0)
    it = make_train_iterator(_cfg(tok_dir, a, b, eval_fraction=0.0), seq_len=64, batch_size=8, seed=0)
    names = [t.split(" ")[0] for _ in range(40) for t in segments(next(it), tok)]
    share = names.count("alpha") / len(names)
    assert len(names) > 600 and abs(share - 0.75) < 0.03, (share, len(names))


def test_hosts_see_disjoint_documents_whose_union_is_everything(tmp_path, tok, tok_dir):
    docs = numbered_docs(37)
    cfg = _cfg(tok_dir, _jsonl_source(tmp_path, "a", docs), eval_fraction=0.0)
    seen = [sorted(segments(_stack(_rows(cfg, tok, 40, process_index=i, process_count=2)), tok)) for i in range(2)]
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == sorted(d for d in docs)
    assert len(seen[0]) == 19 and len(seen[1]) == 18  # document i goes to host i % 2


def _stack(rows):
    return {k: np.stack([r[k] for r in rows]) for k in rows[0]}


def test_train_and_eval_never_share_a_document(tmp_path, tok, tok_dir):
    docs = numbered_docs(200)
    cfg = _cfg(tok_dir, _jsonl_source(tmp_path, "a", docs), eval_fraction=0.2)
    train = set(segments(_stack(_rows(cfg, tok, 64)), tok))
    evals = set(segments(_stack(make_eval_batches(cfg, seq_len=64, batch_size=4, num_batches=100)), tok))
    held = {d for d in docs if content_hash_fraction(d) < 0.2}
    assert evals == held and train == set(docs) - held
    assert 20 < len(held) < 60


def test_eval_batches_are_fixed_and_padded(tmp_path, tok, tok_dir):
    cfg = _cfg(
        tok_dir,
        _jsonl_source(tmp_path, "a", numbered_docs(10)),
        eval_sources=(_jsonl_source(tmp_path, "e", numbered_docs(9, "held")),),
    )
    one = make_eval_batches(cfg, seq_len=64, batch_size=4, num_batches=5)
    two = make_eval_batches(dataclasses.replace(cfg), seq_len=64, batch_size=4, num_batches=5)
    assert len(one) == len(two) >= 1
    for x, y in zip(one, two):
        assert all(np.array_equal(x[k], y[k]) for k in x) and x["tokens"].shape == (4, 64)
    # explicit eval sources are used whole
    assert sorted(segments(_stack([r for b in one for r in _unstack(b)]), tok)) == sorted(numbered_docs(9, "held"))
    with pytest.raises(DataConfigError, match="no evaluation documents"):
        make_eval_batches(
            _cfg(tok_dir, _jsonl_source(tmp_path, "z", ["one"]), eval_fraction=0.0), seq_len=16, batch_size=2
        )


def _unstack(batch):
    return [{k: v[i] for k, v in batch.items()} for i in range(batch["tokens"].shape[0])]


def test_exact_resume_from_json_state(tmp_path, tok, tok_dir):
    a = _jsonl_source(tmp_path, "a", numbered_docs(23, "alpha"), weight=2.0)
    b = SourceConfig(type="directory", path=str(tmp_path / "code"), include=(".py",))
    (tmp_path / "code").mkdir()
    for i in range(9):
        (tmp_path / "code" / f"m{i}.py").write_text(f"# module {i}\n" + "def g():\n    return 1\n" * (i + 1))
    cfg = _cfg(tok_dir, a, b, shuffle_window=8, num_packing_bins=4)
    kw = dict(seq_len=40, batch_size=2, seed=7)
    it = make_train_iterator(cfg, **kw)
    for _ in range(11):  # N batches: past one epoch of the directory source
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # what a checkpoint stores
    after = [next(it) for _ in range(6)]
    fresh = make_train_iterator(cfg, **kw)
    fresh.set_state(state)
    again = [next(fresh) for _ in range(6)]
    for x, y in zip(after, again):
        assert all(np.array_equal(x[k], y[k]) for k in x)
    # a different seed gives a different stream, and its state refuses to load here
    other = make_train_iterator(cfg, **{**kw, "seed": 8})
    assert not np.array_equal(next(other)["tokens"], next(make_train_iterator(cfg, **kw))["tokens"])
    with pytest.raises(DataConfigError, match="seed: saved 8, now 7"):
        fresh.set_state(other.get_state())


def test_source_with_only_held_out_documents_is_an_error(tmp_path, tok_dir):
    held = next(d for d in numbered_docs(100) if content_hash_fraction(d) < 0.5)
    with pytest.raises(
        DataConfigError, match=r"all 1 documents of host 0 fall in the held-out split \(eval_fraction=0.5\)"
    ):
        make_train_iterator(
            _cfg(tok_dir, _jsonl_source(tmp_path, "a", [held]), eval_fraction=0.5), seq_len=16, batch_size=1, seed=0
        )


def test_bad_documents_fail_with_file_and_line(tmp_path, tok_dir):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"text": "fine"}\n{"txt": "wrong key"}\n')
    it = make_train_iterator(
        _cfg(tok_dir, SourceConfig(type="jsonl", path=str(f)), eval_fraction=0.0, shuffle=False),
        seq_len=16,
        batch_size=1,
        seed=0,
    )
    with pytest.raises(DataConfigError, match=r"bad.jsonl:2: record has no key 'text'"):
        next(it)
    with pytest.raises(DataConfigError, match="process_index=2 must be in 0..process_count-1=1"):
        make_train_iterator(
            _cfg(tok_dir, SourceConfig(path=str(f))), seq_len=16, batch_size=1, seed=0, process_index=2, process_count=2
        )


def test_every_token_carries_the_source_its_document_came_from(tmp_path, tok, tok_dir):
    # the documents say which source they are; packing mixes them within rows
    a = _jsonl_source(tmp_path, "a", numbered_docs(20, "alpha"), weight=1.0)
    b = _jsonl_source(tmp_path, "b", numbered_docs(20, "beta"), weight=2.0)
    rows = _rows(_cfg(tok_dir, a, b, eval_fraction=0.0), tok, 48)
    mixed = 0
    for r in rows:
        seg, src = r["segment_ids"], r["source_ids"]
        assert src.dtype == np.int32 and np.all(src[seg == 0] == 0)
        kinds = set()
        for s in np.unique(seg[seg > 0]):
            ids = np.unique(src[seg == s])
            text = tok.decode(r["tokens"][seg == s].tolist(), skip_special_tokens=True)
            assert len(ids) == 1 and int(ids[0]) == (1 if text.lstrip().startswith("alpha") else 2), text
            kinds.add(int(ids[0]))
        mixed += len(kinds) > 1
    assert mixed > 0  # some row holds documents of both sources
