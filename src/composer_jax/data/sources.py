"""Document sources: random-access grain data sources over JSONL, Parquet, ArrayRecord and code trees.

Every source implements grain's `RandomAccessDataSource` protocol (`__len__`, `__getitem__`) and
returns one *document* per index: a `str` (format "pretrain") or a `ChatDocument` (format "chat"):
the row's OpenAI-style messages and, when the row carries them, its own `tools`. Random access is
what lets grain shuffle by index permutation, shard by host with a slice, and checkpoint the
iterator as a handful of integers.

Parsing is lazy (at `__getitem__`), so opening a multi-GB corpus costs one pass to find line
offsets, not a JSON parse of every line; a malformed record raises `DataFormatError` naming the
file, the line (or record) number and what is accepted when the pipeline reaches it.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import glob
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from composer_jax.config.data import (
    DEFAULT_CODE_EXTENSIONS,
    DEFAULT_EXCLUDES,
    SOURCE_TYPES,
    DataConfigError,
    SourceConfig,
)
from composer_jax.formats.chatml import check_tools

Kind = Literal["text", "messages"]
TOOLS_KEY = "tools"  # a chat row's own OpenAI function tools (OpenAI's and Hugging Face's name)
_PRUNED_DIRS = frozenset(
    {".git", ".hg", ".svn", "__pycache__", ".venv", "node_modules", ".pytest_cache", ".mypy_cache", ".ruff_cache"}
)
_DEFAULT_FILE_PATTERN = {"jsonl": "*.jsonl", "parquet": "*.parquet", "arrayrecord": "*.array_record*"}


class DataFormatError(DataConfigError):
    """A record in an input file cannot be read as a document."""


@dataclasses.dataclass(frozen=True)
class ChatDocument:
    """One chat row: its OpenAI-style messages, and the OpenAI function `tools` the row carries
    (None: it carries none, and renders with its chat format's session tools, data/pipeline.py
    `row_tools`; [] is a row that offers no tools)."""

    messages: list[dict]
    tools: list[dict] | None = None


def resolve_files(path: str, file_pattern: str) -> list[Path]:
    """A file, a directory (its `file_pattern` files, sorted) or a glob -> sorted list of files.

    Relative paths resolve against the current working directory (see config/data.py)."""
    p = Path(path)
    if any(c in path for c in "*?["):
        files = sorted(Path(f) for f in glob.glob(path, recursive=True) if Path(f).is_file())
    elif p.is_dir():
        files = sorted(f for f in p.rglob(file_pattern) if f.is_file())
    elif p.is_file():
        files = [p]
    else:
        raise DataConfigError(
            f"source path {path!r} does not exist (relative paths resolve against the "
            f"current directory {Path.cwd()}); give a file, a directory or a glob"
        )
    if not files:
        raise DataConfigError(f"source path {path!r} matches no files (looked for {file_pattern!r})")
    return files


def _document(obj: Any, kind: Kind, key: str, where: str) -> str | ChatDocument:
    """Pull the document out of one parsed record; errors say where and what is accepted."""
    if not isinstance(obj, dict):
        raise DataFormatError(f"{where}: expected a JSON object with key {key!r}, got {type(obj).__name__}")
    if key not in obj:
        raise DataFormatError(
            f"{where}: record has no key {key!r} (keys: {sorted(obj)[:10]}); set the "
            f"source's {'text_key' if kind == 'text' else 'messages_key'} to the key holding the "
            f"{'document text' if kind == 'text' else 'message list'}"
        )
    return _check_value(obj[key], kind, key, where, obj.get(TOOLS_KEY))


def _check_value(value: Any, kind: Kind, key: str, where: str, tools: Any = None) -> str | ChatDocument:
    """The document of a record's `key` value (and, for a chat row, its `tools` value)."""
    if kind == "text":
        if not isinstance(value, str):
            raise DataFormatError(f"{where}: {key!r} must be a string, got {type(value).__name__}")
        return value
    value = _json_field(value, key, where)
    if not isinstance(value, list) or not all(isinstance(m, dict) for m in value):
        raise DataFormatError(
            f"{where}: {key!r} must be a list of message objects "
            '[{"role": ..., "content": ...}], got ' + type(value).__name__
        )
    return ChatDocument(value, _row_tools(tools, where))


def _json_field(value: Any, key: str, where: str) -> Any:
    if isinstance(value, str):  # parquet stores conversations (and tools) as JSON strings
        try:
            return json.loads(value)
        except json.JSONDecodeError as e:
            raise DataFormatError(f"{where}: {key!r} is a string but not JSON ({e.msg})") from None
    return value


def _row_tools(value: Any, where: str) -> list[dict] | None:
    """A chat row's own `tools` (None when it has none, or null); checked as `serve` checks a
    request's, so a malformed entry is named with the row."""
    value = _json_field(value, TOOLS_KEY, where)
    if value is None:
        return None
    try:
        check_tools(value, f"{where}: {TOOLS_KEY!r}")
    except DataConfigError as e:
        raise DataFormatError(str(e)) from None
    return list(value)


class JsonlSource:
    """Lines of one or more JSONL files; blank lines are skipped. Index = position among non-blank lines."""

    def __init__(self, files: Sequence[Path], kind: Kind, key: str):
        self._files = [str(f) for f in files]
        self._kind, self._key = kind, key
        file_ids, offsets, line_nos = [], [], []
        for fi, f in enumerate(self._files):
            with open(f, "rb") as fh:
                pos = 0
                for line_no, line in enumerate(fh, start=1):
                    if line.strip():
                        file_ids.append(fi)
                        offsets.append(pos)
                        line_nos.append(line_no)
                    pos += len(line)
        self._file_ids = np.asarray(file_ids, np.int32)
        self._offsets = np.asarray(offsets, np.int64)
        self._line_nos = np.asarray(line_nos, np.int64)

    def __len__(self) -> int:
        return len(self._offsets)

    def __getitem__(self, index: int) -> str | ChatDocument:
        f = self._files[self._file_ids[index]]
        with open(f, "rb") as fh:
            fh.seek(int(self._offsets[index]))
            line = fh.readline()
        where = f"{f}:{int(self._line_nos[index])}"
        try:
            obj = json.loads(line)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise DataFormatError(
                f"{where}: not valid JSON ({getattr(e, 'msg', e)}); each line must be one JSON "
                f"object like {{{self._key!r}: ...}}"
            ) from None
        return _document(obj, self._kind, self._key, where)


class ParquetSource:
    """One column of one or more Parquet files (read once; only that column is loaded), and for chat
    a `tools` column where a file has one."""

    def __init__(self, files: Sequence[Path], kind: Kind, key: str):
        import pyarrow.parquet as pq

        self._kind, self._key = kind, key
        self._columns: list[Any] = []
        self._tools: list[Any | None] = []  # a file's `tools` column (chat), None where it has none
        self._where: list[str] = []
        starts = [0]
        for f in files:
            schema = pq.read_schema(f)
            if key not in schema.names:
                raise DataFormatError(
                    f"{f}: parquet file has no column {key!r} (columns: {schema.names}); set the "
                    f"source's {'text_key' if kind == 'text' else 'messages_key'}"
                )
            with_tools = kind == "messages" and TOOLS_KEY in schema.names and key != TOOLS_KEY
            table = pq.read_table(f, columns=[key, TOOLS_KEY] if with_tools else [key])
            self._columns.append(table.column(key))
            self._tools.append(table.column(TOOLS_KEY) if with_tools else None)
            self._where.append(str(f))
            starts.append(starts[-1] + table.num_rows)
        self._starts = np.asarray(starts, np.int64)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def __getitem__(self, index: int) -> str | ChatDocument:
        fi = int(np.searchsorted(self._starts, index, side="right")) - 1
        row = index - int(self._starts[fi])
        value = self._columns[fi][row].as_py()
        column = self._tools[fi]
        tools = column[row].as_py() if column is not None else None
        return _check_value(value, self._kind, self._key, f"{self._where[fi]}: row {row}", tools)


class ArrayRecordSource:
    """Records of ArrayRecord files: UTF-8 text, or a JSON object holding `key`."""

    def __init__(self, files: Sequence[Path], kind: Kind, key: str):
        import grain

        self._inner = grain.sources.ArrayRecordDataSource([str(f) for f in files])
        self._kind, self._key = kind, key
        self._label = str(files[0]) + (f" (+{len(files) - 1} files)" if len(files) > 1 else "")

    def __len__(self) -> int:
        return len(self._inner)

    def __getitem__(self, index: int) -> str | ChatDocument:
        raw = self._inner[index]
        where = f"{self._label}: record {index}"
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise DataFormatError(f"{where}: not UTF-8; records must be UTF-8 text or a JSON object") from None
        # A record that parses as a JSON object is a structured record; anything else is plain text.
        obj = None
        if text[:1] == "{":
            try:
                obj = json.loads(text)
            except json.JSONDecodeError:
                obj = None
        if isinstance(obj, dict):
            return _document(obj, self._kind, self._key, where)
        if self._kind == "messages":
            raise DataFormatError(f"{where}: chat records must be JSON objects with key {self._key!r}")
        return text


def _matches(rel: str, patterns: Sequence[str]) -> bool:
    name = rel.rsplit("/", 1)[-1]
    for pat in patterns:
        if pat.startswith(".") and not any(c in pat for c in "*?["):
            if name.endswith(pat):  # an extension such as ".py"
                return True
        elif (
            fnmatch.fnmatchcase(rel, pat)
            or fnmatch.fnmatchcase(name, pat)
            or (pat.startswith("**/") and fnmatch.fnmatchcase(rel, pat[3:]))
        ):
            return True
    return False


def list_directory_files(
    root: str | Path, *, include: Sequence[str], exclude: Sequence[str], max_file_bytes: int
) -> list[str]:
    """Relative POSIX paths of the corpus files under `root`, sorted, de-duplicated by content.

    Kept: files matching `include` (extensions like ".py" or globs on the relative path), not
    matching DEFAULT_EXCLUDES + `exclude`, of at most `max_file_bytes`, decodable as UTF-8 and free
    of NUL bytes (binary files are not text). Of files with identical bytes (SHA-256) only the
    first in sorted path order is kept, so vendored copies do not count twice.
    """
    root = Path(root)
    if not root.is_dir():
        raise DataConfigError(
            f"directory source {str(root)!r} is not a directory (relative paths resolve "
            f"against the current directory {Path.cwd()})"
        )
    include = tuple(include) or DEFAULT_CODE_EXTENSIONS
    exclude = DEFAULT_EXCLUDES + tuple(exclude)
    candidates = []
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        dirnames[:] = [d for d in dirnames if d not in _PRUNED_DIRS]  # never walk into these at all
        reldir = Path(dirpath).relative_to(root).as_posix()
        for fn in filenames:
            rel = fn if reldir == "." else f"{reldir}/{fn}"
            if _matches(rel, include) and not _matches(rel, exclude):
                candidates.append(rel)
    seen: set[bytes] = set()
    kept = []
    for rel in sorted(candidates):  # sorted first, so "first copy" does not depend on walk order
        full = root / rel
        if full.is_symlink() or full.stat().st_size > max_file_bytes:
            continue
        data = full.read_bytes()
        if b"\x00" in data:
            continue
        try:
            data.decode("utf-8")
        except UnicodeDecodeError:
            continue
        digest = hashlib.sha256(data).digest()
        if digest not in seen:
            seen.add(digest)
            kept.append(rel)
    return kept


class DirectorySource:
    """Files of a code tree as documents (the text of one file each)."""

    def __init__(self, root: Path, files: Sequence[str]):
        self._root, self._files = Path(root), list(files)

    @property
    def files(self) -> list[str]:
        return list(self._files)

    def __len__(self) -> int:
        return len(self._files)

    def __getitem__(self, index: int) -> str:
        return (self._root / self._files[index]).read_text(encoding="utf-8")


def open_source(src: SourceConfig, kind: Kind):
    """SourceConfig -> a random-access source of documents (str for kind "text", ChatDocument for
    "messages")."""
    key = src.text_key if kind == "text" else src.messages_key
    if src.type == "directory":
        if kind != "text":
            raise DataConfigError(f"source {src.label}: a directory source holds files, not conversations")
        files = list_directory_files(
            src.path, include=src.include, exclude=src.exclude, max_file_bytes=src.max_file_bytes
        )
        if not files:
            raise DataConfigError(
                f"directory source {src.path!r} has no files matching include="
                f"{src.include or DEFAULT_CODE_EXTENSIONS} (after excludes and max_file_bytes="
                f"{src.max_file_bytes})"
            )
        return DirectorySource(Path(src.path), files)
    if src.type not in _DEFAULT_FILE_PATTERN:
        raise DataConfigError(
            f"source {src.path!r}: type={src.type!r} is not accepted; accepted: {', '.join(SOURCE_TYPES)}"
        )
    paths = resolve_files(src.path, _DEFAULT_FILE_PATTERN[src.type])
    cls = {"jsonl": JsonlSource, "parquet": ParquetSource, "arrayrecord": ArrayRecordSource}[src.type]
    return cls(paths, kind, key)


def content_hash_fraction(document: str | list | ChatDocument) -> float:
    """A stable number in [0, 1) from a document's content (BLAKE2b), for the train/eval split.

    Depends on nothing but the content: the same document lands on the same side on every host,
    every run and in every source that contains it. A chat row hashes its messages only, so the
    same conversation offered other tools never lands on both sides (and a row's side did not move
    when rows' `tools` began to be read)."""
    if isinstance(document, ChatDocument):
        document = document.messages
    if not isinstance(document, str):
        document = json.dumps(document, sort_keys=True, ensure_ascii=False)
    h = hashlib.blake2b(document.encode("utf-8"), digest_size=8, person=b"cj-split").digest()
    return int.from_bytes(h, "little") / 2.0**64
