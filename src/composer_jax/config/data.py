"""Data configuration: where documents come from, how they are mixed, tokenized and packed.

Frozen dataclasses with no JAX import, attached to the top-level `Config` as `data:` so that YAML
reads `data.sources`, `data.tokenizer`, ... Relative paths (source paths, the tokenizer) resolve
against the CURRENT WORKING DIRECTORY of the process that builds the pipeline; launch jobs from the
repository root (as `composer-jax` and the tests do) or give absolute paths.

Example (YAML):

    data:
      tokenizer: assets/tokenizer
      format: pretrain
      sources:
        - {type: directory, path: src, weight: 3.0, include: [".py", ".md"]}
        - {type: jsonl, path: corpus/docs.jsonl, weight: 1.0, text_key: text}
      eval_fraction: 0.05
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal

from composer_jax.errors import ConfigError

# each accepted-name set written once, as the field's type; the tuples are derived from it
SourceType = Literal["jsonl", "parquet", "arrayrecord", "directory"]
SOURCE_TYPES: tuple[str, ...] = typing.get_args(SourceType)
DataFormat = Literal["pretrain", "chat"]
FORMATS: tuple[str, ...] = typing.get_args(DataFormat)
Packing = Literal["first_fit"]
PACKINGS: tuple[str, ...] = typing.get_args(Packing)

# File types a code repository used as a corpus is made of, when `include` is not given.
DEFAULT_CODE_EXTENSIONS = (
    ".py",
    ".md",
    ".toml",
    ".sh",
    ".yaml",
    ".yml",
    ".txt",
    ".json",
    ".cfg",
    ".ini",
    ".c",
    ".h",
    ".cc",
    ".cpp",
    ".rs",
    ".go",
    ".js",
    ".ts",
    ".java",
)
# Never corpus material: version control, caches, virtual environments, build outputs.
DEFAULT_EXCLUDES = (
    ".git/**",
    "**/.git/**",
    "**/__pycache__/**",
    "**/.venv/**",
    ".venv/**",
    "**/node_modules/**",
    "**/*.egg-info/**",
    "**/.pytest_cache/**",
    "build/**",
    "dist/**",
)


class DataConfigError(ConfigError):
    """A data configuration value or input file is invalid; the message names it and what is accepted."""


@dataclasses.dataclass(frozen=True)
class SourceConfig:
    """One corpus in the mixture.

    type:
      jsonl        one JSON object per line; the document is `obj[text_key]` (pretrain) or
                   `obj[messages_key]` (chat). `path` is a file, a directory of `*.jsonl`, or a glob.
      parquet      a column `text_key` (pretrain) or `messages_key` holding JSON strings / lists
                   (chat). `path` is a file, a directory of `*.parquet`, or a glob.
      arrayrecord  records are UTF-8 text, or a JSON object holding `text_key` / `messages_key`
                   (detected per record: a record that parses as a JSON object is one).
                   `path` is a file, a directory of `*.array_record`, or a glob.
      directory    a tree of source files (a code repository as a corpus); each file is one
                   document. Files are filtered by `include` (extensions like ".py" or globs like
                   "src/**/*.py"), `exclude` (globs relative to `path`), `max_file_bytes`, and
                   de-duplicated by content hash (the first path in sorted order is kept).
    weight: relative sampling weight in the training mixture (> 0); normalised over sources.
    eval_fraction: share of documents held out for evaluation, chosen by a stable hash of the
      document's content, so train and eval never share a document and the split does not depend
      on file order, host count or seed. None = use `DataConfig.eval_fraction`.
    """

    type: SourceType = "jsonl"
    path: str = ""
    weight: float = 1.0
    text_key: str = "text"
    messages_key: str = "messages"
    include: tuple[str, ...] = ()  # directory only; () = DEFAULT_CODE_EXTENSIONS
    exclude: tuple[str, ...] = ()  # directory only; added to DEFAULT_EXCLUDES
    max_file_bytes: int = 1_000_000  # directory only; larger files are skipped (generated/minified)
    eval_fraction: float | None = None
    name: str = ""  # for logs and per-source statistics; default: the path

    @property
    def label(self) -> str:
        return self.name or f"{self.type}:{self.path}"


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The data pipeline of one training stage.

    sources: the training mixture (each with a weight).
    eval_sources: held-out sources used whole for evaluation; () = the held-out split
      (`eval_fraction`) of `sources`.
    tokenizer: a `tokenizer.json` file or a directory holding one (e.g. a checkpoint directory or
      assets/tokenizer); special tokens are read from tokenizer_config.json next to it if present.
    format: "pretrain" (documents are text: BOS + text + EOS) or "chat" (documents are OpenAI-style
      message lists rendered with the chat template in formats/chatml.py; loss on assistant turns only).
    shuffle: shuffle documents (a full per-epoch permutation of each source's document indices,
      re-drawn every epoch) and packed rows (a window of `shuffle_window` rows).
    shuffle_seed: data seed; combined with the run's seed given to `make_train_iterator`.
    num_packing_bins: rows the first-fit packer fills at once; more bins pack tighter (less
      padding) but hold more documents in memory.
    max_chunks_per_document: a document longer than the sequence is cut into chunks of seq_len
      tokens; chunks past this many are dropped (bounds one huge file's share of a batch).
    eval_batches: the number of fixed held-out batches `make_eval_batches` returns by default.
    shards: independent streams the global batch is cut into (each reads documents i::shards and
      fills batch_size/shards rows of every batch); a host reads the shards whose rows it holds,
      so the batches do not depend on the host count. 0 = one shard per host (process).
    """

    sources: tuple[SourceConfig, ...] = ()
    eval_sources: tuple[SourceConfig, ...] = ()
    tokenizer: str = "assets/tokenizer"
    format: DataFormat = "pretrain"
    eval_fraction: float = 0.02
    shuffle: bool = True
    shuffle_seed: int = 0
    shuffle_window: int = 64
    packing: Packing = "first_fit"
    num_packing_bins: int = 16
    max_chunks_per_document: int = 64
    eval_batches: int = 8
    shards: int = 0


def validate_data_config(cfg: DataConfig, *, require_sources: bool = True) -> None:
    """Raise DataConfigError naming the key, the value and what is accepted."""

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise DataConfigError(msg)

    if require_sources:
        need(
            len(cfg.sources) > 0,
            "data.sources is empty; give at least one source, e.g. data.sources=[{type: directory, path: src}]",
        )
    need(cfg.format in FORMATS, f"data.format={cfg.format!r} is not accepted; accepted: {FORMATS}")
    need(cfg.packing in PACKINGS, f"data.packing={cfg.packing!r} is not accepted; accepted: {PACKINGS}")
    need(0.0 <= cfg.eval_fraction < 1.0, f"data.eval_fraction={cfg.eval_fraction} must be in [0, 1)")
    need(cfg.shuffle_window >= 0, f"data.shuffle_window={cfg.shuffle_window} must be >= 0 (0 = off)")
    need(cfg.num_packing_bins >= 1, f"data.num_packing_bins={cfg.num_packing_bins} must be >= 1")
    need(cfg.max_chunks_per_document >= 1, f"data.max_chunks_per_document={cfg.max_chunks_per_document} must be >= 1")
    need(cfg.eval_batches >= 0, f"data.eval_batches={cfg.eval_batches} must be >= 0")
    need(cfg.shards >= 0, f"data.shards={cfg.shards} must be >= 0 (0 = one shard per process)")
    for group, sources in (("sources", cfg.sources), ("eval_sources", cfg.eval_sources)):
        for i, s in enumerate(sources):
            key = f"data.{group}[{i}]"
            if not isinstance(s, SourceConfig):
                raise DataConfigError(f"{key}: expected a SourceConfig mapping, got {s!r}")
            need(s.type in SOURCE_TYPES, f"{key}.type={s.type!r} is not accepted; accepted: {SOURCE_TYPES}")
            need(bool(s.path), f"{key}.path is empty; give a file, directory or glob")
            need(s.weight > 0, f"{key}.weight={s.weight} must be > 0")
            need(
                s.eval_fraction is None or 0.0 <= s.eval_fraction < 1.0,
                f"{key}.eval_fraction={s.eval_fraction} must be in [0, 1) or null",
            )
            need(s.max_file_bytes > 0, f"{key}.max_file_bytes={s.max_file_bytes} must be > 0")
            if cfg.format == "chat":
                need(
                    s.type != "directory",
                    f"{key}.type='directory' holds source files, not "
                    "conversations; data.format='chat' accepts jsonl, parquet, arrayrecord",
                )
