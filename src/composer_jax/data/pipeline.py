"""Training and evaluation streams on grain: sources -> split -> tokenize -> mix -> first-fit pack -> batch.

Per source (all grain datasets, so the whole chain checkpoints as integers):

    MapDataset.source(documents)[process_index::process_count]   per-host shard, disjoint by index
      .shuffle(seed).repeat()                                      fresh permutation every epoch
      .to_iter_dataset()
      FlatMapIterDataset(DocumentToChunks)                         hash split, BOS+text+EOS, chunks

then `IterDataset.mix(streams, weights)` (deterministic weighted interleave), `FirstFitPackIterDataset`
into rows of seq_len, `WindowShuffleIterDataset` over rows, and `batch(batch_size)`.

The batch contract with the trainer (numpy, each [per_host_batch, seq_len]):
  tokens       int32    token ids; the tokenizer's pad id where segment_ids == 0
  segment_ids  int32    1, 2, ... per document chunk in the row, 0 = padding
  positions    int32    position within its segment (0 at a segment's first token and at padding)
  loss_mask    float32  1.0 where the token is a valid target: pretrain = every non-padding token
                        except the first of each segment; chat = assistant tokens (formats/chatml.py),
                        also 0.0 at each segment's first token.
  source_ids   int32    1 + the index in data.sources (or data.eval_sources) of the source the
                        token's document came from, 0 = padding (per-source losses of a mixture)
The trainer's loss at position i predicts tokens[i+1], weighted by
loss_mask[i+1] * (segment_ids[i+1] == segment_ids[i]).
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import Iterator
from typing import Any

import grain
import numpy as np

from composer_jax.config.data import DataConfig, DataConfigError, SourceConfig, validate_data_config
from composer_jax.data.sources import ChatDocument, content_hash_fraction, open_source
from composer_jax.formats.chat_interface import ChatFormat
from composer_jax.formats.tokenizer import Tokenizer, load_tokenizer

STATE_VERSION = 1
# Source reads are I/O; a couple of threads hide file latency without competing with the
# single-threaded tokenizer for the CPU. Prefetching does not change the order or the state.
_READ_OPTIONS = grain.ReadOptions(num_threads=2, prefetch_buffer_size=32)


class DocumentToChunks(grain.experimental.FlatMapTransform):
    """document -> 0..max_chunks examples {"tokens": int32[<=seq_len], "loss_mask": float32[same],
    "source_ids": int32[same] (all `source_id`)}.

    Split: a document is held out when content_hash_fraction(doc) < eval_fraction; split "train"
    keeps the others, "eval" the held-out ones, "all" everything (explicit eval sources).
    Pretrain documents become [BOS] + encode(text) + [EOS]; chat documents their chat format's
    `conversation` (formats/chat_format.py) with the tools `row_tools` gives them: the row's own,
    else the session's where the format takes them. A sequence longer than seq_len is cut into consecutive
    chunks of seq_len tokens (the last one shorter); each chunk is its own segment with positions
    from 0, and chunks past `max_chunks` are dropped. No overlap between chunks: every token is a target at most once.
    """

    def __init__(
        self,
        tok: Tokenizer,
        fmt: str,
        split: str,
        eval_fraction: float,
        seq_len: int,
        max_chunks: int,
        source_id: int = 1,
    ):
        self.tok, self.fmt, self.split = tok, fmt, split
        self.eval_fraction, self.seq_len, self.max_fan_out = eval_fraction, seq_len, max_chunks
        self.source_id = source_id

    def flat_map(self, document: Any) -> list[dict[str, np.ndarray]]:
        if self.split != "all":
            held_out = content_hash_fraction(document) < self.eval_fraction
            if held_out != (self.split == "eval"):
                return []
        if self.fmt == "chat":
            from composer_jax.formats.chat_format import chat_format

            chat = chat_format(self.tok)
            tokens, loss_mask = chat.conversation(document.messages, tools=row_tools(document, chat)[0])
        else:
            tokens = np.asarray([self.tok.bos_id, *self.tok.encode(document), self.tok.eos_id], np.int32)
            loss_mask = np.ones(len(tokens), np.float32)
        n = min(len(tokens), self.seq_len * self.max_fan_out)
        source = np.full(len(tokens), self.source_id, np.int32)
        return [
            {
                "tokens": tokens[a : a + self.seq_len],
                "loss_mask": loss_mask[a : a + self.seq_len],
                "source_ids": source[a : a + self.seq_len],
            }
            for a in range(0, n, self.seq_len)
        ]


def row_tools(document: ChatDocument, chat: ChatFormat) -> tuple[list[dict] | None, str]:
    """The tools a chat row renders with, and whose they are: the row's own `tools` when it carries
    them ("row"; [] offers none), else the session's default tools where the format takes tools
    (`ChatFormat.native_tools`: what the agent loop gives the model, "session"), else none ("none":
    composer-chatml-v1 names its tools in the system prompt)."""
    if document.tools is not None:
        return document.tools, "row"
    if chat.native_tools:
        return session_tools(), "session"
    return None, "none"


def session_tools() -> list[dict]:
    """The tool schemas an environment session offers by default (env.api.protocol): what the agent
    loop gives a native-tools template (`ChatFormat.native_tools`), so SFT rows rendered in a
    checkpoint's own template hold the same tool definitions as the prompts RL samples from."""
    from composer_jax.env.api.protocol import session_tool_names, tool_schemas

    return tool_schemas(session_tool_names(False))


def _seed(*parts: int) -> int:
    """Independent 31-bit seeds from (data seed, run seed, source index) tuples."""
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(1)[0] >> 1)


def _source_stream(
    index: int,
    src: SourceConfig,
    cfg: DataConfig,
    tok: Tokenizer,
    *,
    split: str,
    seq_len: int,
    seed: int,
    process_index: int,
    process_count: int,
    shuffle: bool,
    num_epochs: int | None,
) -> grain.IterDataset:
    docs = open_source(src, "messages" if cfg.format == "chat" else "text")
    ds = grain.MapDataset.source(docs)[process_index::process_count]
    if len(ds) == 0:
        raise DataConfigError(
            f"source {src.label} has {len(docs)} documents, too few to give each of "
            f"{process_count} hosts one (host {process_index} gets none)"
        )
    frac = cfg.eval_fraction if src.eval_fraction is None else src.eval_fraction
    if split == "train" and num_epochs is None and frac > 0:
        _require_a_training_document(ds, frac, src, process_index)
    if shuffle:
        ds = ds.shuffle(seed=_seed(cfg.shuffle_seed, seed, index))
    if num_epochs != 1:
        ds = ds.repeat(num_epochs)  # None = infinite; ShuffleMapDataset re-permutes each epoch
    transform = DocumentToChunks(tok, cfg.format, split, frac, seq_len, cfg.max_chunks_per_document, index + 1)
    return grain.experimental.FlatMapIterDataset(ds.to_iter_dataset(_READ_OPTIONS), transform)


def _require_a_training_document(ds: grain.MapDataset, frac: float, src: SourceConfig, host: int) -> None:
    """An infinite stream over a source whose documents are all held out would never yield: fail
    now instead. Stops at the first training document, so this reads ~1/(1 - frac) documents."""
    for i in range(len(ds)):
        if content_hash_fraction(ds[i]) >= frac:
            return
    raise DataConfigError(
        f"source {src.label}: all {len(ds)} documents of host {host} fall in the held-out "
        f"split (eval_fraction={frac}); lower eval_fraction (0 keeps all for training) or add "
        "documents"
    )


def _finalize(pad_id: int):
    def finalize(row: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        seg = row["tokens_segment_ids"].astype(np.int32)
        pos = row["tokens_positions"].astype(np.int32)
        # The first token of a segment has no in-segment predecessor, so it is never a target.
        mask = np.where((seg > 0) & (pos > 0), row["loss_mask"], 0.0).astype(np.float32)
        return {
            "tokens": np.where(seg > 0, row["tokens"], pad_id).astype(np.int32),
            "segment_ids": seg,
            "positions": np.where(seg > 0, pos, 0).astype(np.int32),
            "loss_mask": mask,
            "source_ids": np.where(seg > 0, row["source_ids"], 0).astype(np.int32),
        }

    return finalize


def _pack(ds: grain.IterDataset, cfg: DataConfig, tok: Tokenizer, seq_len: int, seed: int, shuffle: bool):
    packed = grain.experimental.FirstFitPackIterDataset(
        ds,
        length_struct={"tokens": seq_len, "loss_mask": seq_len, "source_ids": seq_len},
        num_packing_bins=cfg.num_packing_bins,
        seed=seed,
        shuffle_bins=shuffle,
    )
    return packed.map(_finalize(tok.pad_id))


def _check_shapes(seq_len: int, batch_size: int, process_index: int, process_count: int) -> None:
    if seq_len < 2 or batch_size < 1:
        raise DataConfigError(f"seq_len={seq_len} must be >= 2 and batch_size={batch_size} >= 1")
    if not 0 <= process_index < process_count:
        raise DataConfigError(f"process_index={process_index} must be in 0..process_count-1={process_count - 1}")


def _jsonable(obj: Any) -> Any:
    if isinstance(obj, dict):
        return {str(k): _jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, bytes):
        return obj.decode("latin-1")
    return obj


class DataIterator:
    """The training stream of one host: `next(it)` -> batch dict (see module docstring).

    `get_state()` returns JSON-able data (store it in the checkpoint); `set_state(state)` on an
    iterator built from the same data config, seq_len, batch_size, seed and host layout resumes
    exactly: the batches that follow are identical to those the saved iterator would have given.
    """

    def __init__(self, dataset: grain.IterDataset, pipeline: dict[str, Any]):
        self._iter = iter(dataset)
        self._pipeline = pipeline

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        return next(self._iter)

    def get_state(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "pipeline": self._pipeline, "grain": _jsonable(self._iter.get_state())}

    def set_state(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or state.get("version") != STATE_VERSION or "grain" not in state:
            raise DataConfigError(
                f"data iterator state must be a dict from get_state() with version "
                f"{STATE_VERSION}; got {str(state)[:200]}"
            )
        saved = state.get("pipeline", {})
        diff = sorted(k for k in set(saved) | set(self._pipeline) if saved.get(k) != self._pipeline.get(k))
        if diff:
            detail = "; ".join(f"{k}: saved {saved.get(k)!r}, now {self._pipeline.get(k)!r}" for k in diff)
            raise DataConfigError(
                "cannot resume the data iterator: the saved state comes from a different "
                f"pipeline ({detail[:600]}). Resume with the same data config, seq_len, "
                "batch size, seed and host count, or start the data stream afresh."
            )
        self._iter.set_state(copy.deepcopy(state["grain"]))


def _pipeline_fingerprint(cfg: DataConfig, tok: Tokenizer, **shape: int) -> dict[str, Any]:
    from composer_jax.config import to_dict

    keep = {k: v for k, v in to_dict(cfg).items() if k not in ("eval_sources", "eval_batches", "tokenizer", "shards")}
    # JSON round trip so that a fingerprint read back from a checkpoint compares equal.
    return json.loads(json.dumps({"data": keep, "vocab_size": tok.vocab_size, **shape}))


def train_rows(
    data_cfg: DataConfig,
    tok: Tokenizer,
    *,
    seq_len: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
    num_epochs: int | None = None,
) -> grain.IterDataset:
    """The unbatched training stream: packed rows {tokens, segment_ids, positions, source_ids:
    int32[seq_len], loss_mask: float32[seq_len]}. num_epochs=None repeats forever (training); a finite count is
    for tests and corpus statistics (the mixture then stops when its first source runs out)."""
    streams = [
        _source_stream(
            i,
            s,
            data_cfg,
            tok,
            split="train",
            seq_len=seq_len,
            seed=seed,
            process_index=process_index,
            process_count=process_count,
            shuffle=data_cfg.shuffle,
            num_epochs=num_epochs,
        )
        for i, s in enumerate(data_cfg.sources)
    ]
    weights = [s.weight for s in data_cfg.sources]
    mixed = streams[0] if len(streams) == 1 else grain.IterDataset.mix(streams, weights)
    ds = _pack(mixed, data_cfg, tok, seq_len, _seed(data_cfg.shuffle_seed, seed, 1 << 20), data_cfg.shuffle)
    if data_cfg.shuffle and data_cfg.shuffle_window > 1:
        ds = grain.experimental.WindowShuffleIterDataset(
            ds, window_size=data_cfg.shuffle_window, seed=_seed(data_cfg.shuffle_seed, seed, 1 << 21)
        )
    return ds


def make_train_iterator(
    data_cfg: DataConfig, *, seq_len: int, batch_size: int, seed: int, process_index: int = 0, process_count: int = 1
) -> DataIterator:
    """This host's infinite training stream of packed batches, each array [batch_size, seq_len].

    batch_size is the per-host batch. Hosts read disjoint documents (index i goes to host
    i % process_count); every host must build its iterator with the same arguments except
    process_index."""
    validate_data_config(data_cfg)
    _check_shapes(seq_len, batch_size, process_index, process_count)
    tok = load_tokenizer(data_cfg.tokenizer)
    ds = train_rows(
        data_cfg, tok, seq_len=seq_len, seed=seed, process_index=process_index, process_count=process_count
    ).batch(batch_size, drop_remainder=True)
    fingerprint = _pipeline_fingerprint(
        data_cfg,
        tok,
        seq_len=seq_len,
        batch_size=batch_size,
        seed=seed,
        process_index=process_index,
        process_count=process_count,
    )
    return DataIterator(ds, fingerprint)


def padding_rows(n: int, seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
    return {
        "tokens": np.full((n, seq_len), pad_id, np.int32),
        "segment_ids": np.zeros((n, seq_len), np.int32),
        "positions": np.zeros((n, seq_len), np.int32),
        "loss_mask": np.zeros((n, seq_len), np.float32),
        "source_ids": np.zeros((n, seq_len), np.int32),
    }


@functools.lru_cache(maxsize=8)
def _eval_batches_cached(
    data_cfg: DataConfig, seq_len: int, batch_size: int, num_batches: int, process_index: int, process_count: int
) -> tuple[dict[str, np.ndarray], ...]:
    tok = load_tokenizer(data_cfg.tokenizer)
    explicit = bool(data_cfg.eval_sources)
    sources = data_cfg.eval_sources if explicit else data_cfg.sources
    streams = [
        _source_stream(
            i,
            s,
            data_cfg,
            tok,
            split="all" if explicit else "eval",
            seq_len=seq_len,
            seed=0,
            process_index=process_index,
            process_count=process_count,
            shuffle=False,
            num_epochs=1,
        )
        for i, s in enumerate(sources)
    ]
    # Round-robin over sources (not weighted mixing, which stops at the first exhausted source),
    # in file order, no shuffling: the same rows every call.
    ds = (
        streams[0]
        if len(streams) == 1
        else grain.experimental.InterleaveIterDataset(streams, cycle_length=len(streams))
    )
    ds = _pack(ds, data_cfg, tok, seq_len, seed=0, shuffle=False).batch(batch_size, drop_remainder=False)
    batches = []
    for batch in ds:
        n = batch["tokens"].shape[0]
        if n < batch_size:  # the trainer compiles one shape: fill the last batch with padding rows
            pad = padding_rows(batch_size - n, seq_len, tok.pad_id)
            batch = {k: np.concatenate([v, pad[k]]) for k, v in batch.items()}
        batches.append(batch)
        if len(batches) == num_batches:
            break
    if not batches:
        what = (
            "data.eval_sources"
            if explicit
            else f"the held-out split (eval_fraction={data_cfg.eval_fraction}) of data.sources"
        )
        raise DataConfigError(
            f"no evaluation documents: {what} is empty; raise data.eval_fraction or set data.eval_sources"
        )
    for b in batches:
        for v in b.values():
            v.flags.writeable = False
    return tuple(batches)


def make_eval_batches(
    data_cfg: DataConfig,
    *,
    seq_len: int,
    batch_size: int,
    num_batches: int | None = None,
    process_index: int = 0,
    process_count: int = 1,
) -> list[dict[str, np.ndarray]]:
    """The fixed held-out set: up to num_batches (default data.eval_batches) batches of
    [batch_size, seq_len] arrays, identical on every call (cached per process).

    From `data.eval_sources` when given, else the documents of `data.sources` held out by content
    hash (never seen by the training stream). Fewer batches come back when the held-out documents
    run out; the last one is filled with padding rows (loss_mask 0)."""
    validate_data_config(data_cfg, require_sources=not data_cfg.eval_sources)
    _check_shapes(seq_len, batch_size, process_index, process_count)
    n = data_cfg.eval_batches if num_batches is None else num_batches
    if n < 1:
        raise DataConfigError(f"num_batches={n} must be >= 1")
    if not data_cfg.sources and not data_cfg.eval_sources:
        raise DataConfigError("data.sources and data.eval_sources are both empty")
    return list(_eval_batches_cached(data_cfg, seq_len, batch_size, n, process_index, process_count))


__all__ = [
    "DataIterator",
    "DocumentToChunks",
    "make_eval_batches",
    "make_train_iterator",
    "train_rows",
    "STATE_VERSION",
]
