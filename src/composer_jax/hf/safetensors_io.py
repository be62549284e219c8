"""Lazy safetensors reading and streaming writing with numpy + ml_dtypes (no torch needed).

Format (https://github.com/huggingface/safetensors): 8-byte little-endian header length N, N bytes of
JSON `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the
tensor bytes (C order, little endian), offsets relative to the end of the header.

The `safetensors` package's numpy backend rejects bfloat16 and float8 tensors, which every DeepSeek /
Kimi checkpoint holds, so tensors are read through `np.memmap`: a slice of a tensor touches only the
pages it covers, and nothing is read before it is asked for. Headers are checked as strictly as the
reference reader checks them (`read_tensors`), since a memory map would otherwise read whatever bytes
a wrong offset points at.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import ml_dtypes
import numpy as np

from composer_jax.errors import UserError

# safetensors dtype code -> bits per element: every code the reference reader (the `safetensors`
# package) accepts, so a header is accepted or rejected exactly as it is there. F4 and F6 are packed
# several to a byte; their headers are checked, but `get` cannot return them as numpy arrays.
BITS: dict[str, int] = {
    "BOOL": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F8_E4M3FNUZ": 8,
    "F8_E5M2FNUZ": 8,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "C64": 64,
    "F64": 64,
    "I64": 64,
    "U64": 64,
}

# safetensors dtype code <-> numpy dtype (the codes `get` can return)
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "F8_E8M0": np.dtype(ml_dtypes.float8_e8m0fnu),
    "F8_E4M3FNUZ": np.dtype(ml_dtypes.float8_e4m3fnuz),
    "F8_E5M2FNUZ": np.dtype(ml_dtypes.float8_e5m2fnuz),
    "C64": np.dtype(np.complex64),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U64": np.dtype(np.uint64),
    "U32": np.dtype(np.uint32),
    "U16": np.dtype(np.uint16),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
CODES: dict[np.dtype, str] = {v: k for k, v in DTYPES.items()}

# The reference reader's limit on the header length, in bytes.
MAX_HEADER = 100_000_000
_U64 = 2**64  # offsets and dimensions are u64 there; larger values (or products) are rejected

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class SafetensorsError(UserError, ValueError):
    """A safetensors file or index is malformed or does not hold what it should (the user's file,
    not a bug)."""


class TensorInfo:
    """One tensor of a file: code is its safetensors dtype, dtype the numpy one (None for the packed
    sub-byte codes), offset its first byte in the file, nbytes its size (= prod(shape) x itemsize)."""

    __slots__ = ("name", "file", "code", "dtype", "shape", "offset", "nbytes")

    def __init__(self, name: str, file: Path, code: str, shape: tuple[int, ...], offset: int, nbytes: int):
        self.name, self.file, self.code, self.shape, self.offset, self.nbytes = name, file, code, shape, offset, nbytes
        self.dtype: np.dtype | None = DTYPES.get(code)


def _reject_constant(token: str):
    raise ValueError(f"{token} is not JSON")  # Python's json takes NaN/Infinity; the format does not


def read_header(path: Path) -> tuple[dict, int]:
    """(header dict, byte offset where tensor data starts), the header checked to be a UTF-8 JSON
    object that fits in the file. The entries are checked by `read_tensors`."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise SafetensorsError(
                f"{path}: {size} bytes, too short to be a safetensors file (8-byte header length, then the header)"
            )
        (n,) = struct.unpack("<Q", raw)
        if n > MAX_HEADER:
            raise SafetensorsError(
                f"{path}: header length {n} is over the format's limit of {MAX_HEADER} bytes; not a safetensors file?"
            )
        if 8 + n > size:
            raise SafetensorsError(
                f"{path}: header length {n} runs past the end of the file ({size} bytes); "
                f"the file is truncated or not a safetensors file"
            )
        raw = f.read(n)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise SafetensorsError(
            f"{path}: header is not UTF-8 (byte {e.start} of the header: "
            f"{raw[e.start : e.start + 4]!r}); the format's header is UTF-8 JSON"
        ) from None
    try:
        header = json.loads(text, parse_constant=_reject_constant)
        # a lone surrogate escape ("\ud800") parses in Python but is not Unicode text: re-encoding the
        # strings finds it (the reference reader rejects such headers too)
        json.dumps(header, ensure_ascii=False).encode("utf-8")
    except (ValueError, UnicodeEncodeError) as e:
        raise SafetensorsError(f"{path}: header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise SafetensorsError(
            f"{path}: header is a JSON {type(header).__name__}; expected an object "
            f"{{tensor name: {{dtype, shape, data_offsets}}}}"
        )
    return header, 8 + n


def _u64(x) -> bool:
    return type(x) is int and 0 <= x < _U64  # bool is an int subclass, and not a size


def read_tensors(path: Path) -> dict[str, TensorInfo]:
    """Every tensor of one safetensors file, its header checked as strictly as the reference reader
    checks it: known dtype, shape of non-negative ints, data_offsets [begin, end] with
    end - begin == prod(shape) x itemsize, and the tensors tiling the data section exactly (sorted by
    offsets, each begins where the previous ends, the last ends at the end of the file: no overlap, no
    gap, no trailing bytes). Raises SafetensorsError naming the file and the tensor."""
    header, start = read_header(path)
    data_size = os.path.getsize(path) - start
    meta = header.pop("__metadata__", None)
    if meta is not None and not (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values())):
        raise SafetensorsError(
            f"{path}: __metadata__ is {json.dumps(meta)[:80]}; expected an object of strings (or absent)"
        )
    spans: list[tuple[int, int, str]] = []
    tensors: dict[str, TensorInfo] = {}
    for name, entry in header.items():
        where = f"{path}: tensor {name!r}"
        if not isinstance(entry, dict) or not {"dtype", "shape", "data_offsets"} <= entry.keys():
            raise SafetensorsError(
                f"{where}: entry is {json.dumps(entry)[:80]}; expected an object with dtype, shape and data_offsets"
            )
        code, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        if not isinstance(code, str) or code not in BITS:
            raise SafetensorsError(f"{where} has dtype {code!r}; accepted: {', '.join(BITS)}")
        if not isinstance(shape, list) or not all(_u64(d) for d in shape):
            raise SafetensorsError(f"{where} has shape {shape!r}; expected a list of non-negative integers")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_u64(o) for o in offsets)):
            raise SafetensorsError(
                f"{where} has data_offsets {offsets!r}; expected [begin, end], two non-negative integers"
            )
        count = 1
        for d in shape:  # the reference reader counts elements, then bits, in a u64: match its overflow
            count *= d
            if count >= _U64:
                break
        nbits = count * BITS[code]
        if nbits >= _U64:
            raise SafetensorsError(f"{where}: shape {shape} of {code} overflows 64-bit sizes")
        if nbits % 8:
            raise SafetensorsError(
                f"{where}: shape {shape} of packed {code} ({BITS[code]} bits each) does not fill whole bytes"
            )
        begin, end = offsets
        if begin > end:
            raise SafetensorsError(f"{where} has data_offsets [{begin}, {end}]; expected begin <= end")
        if end - begin != nbits // 8:
            raise SafetensorsError(
                f"{where} has data_offsets [{begin}, {end}] ({end - begin} bytes); its "
                f"dtype {code} x shape {shape} needs {nbits // 8} bytes"
            )
        spans.append((begin, end, name))
        tensors[name] = TensorInfo(name, path, code, tuple(shape), start + begin, end - begin)
    # In data order: a truncated file names the first tensor it cuts. Overlaps are looked for before
    # gaps, since a tensor pointed into another one usually leaves a gap too, and the overlap names
    # both tensors involved.
    spans.sort()
    reach, last = 0, None  # the furthest end so far, and whose
    for begin, end, name in spans:
        if end > data_size:
            raise SafetensorsError(
                f"{path}: tensor {name!r} has data_offsets [{begin}, {end}], past the end "
                f"of the data section ({data_size} bytes); the file is truncated?"
            )
        if begin < reach:
            raise SafetensorsError(
                f"{path}: tensor {name!r} (data_offsets [{begin}, {end}]) overlaps tensor "
                f"{last!r}, which ends at {reach}"
            )
        reach, last = end, name
    covered = 0
    for begin, end, name in spans:
        if begin > covered:
            raise SafetensorsError(
                f"{path}: tensor {name!r} begins at {begin}, leaving bytes [{covered}, "
                f"{begin}) of the data section in no tensor; the format requires the "
                f"tensors to tile the data section"
            )
        covered = end
    if covered != data_size:
        raise SafetensorsError(
            f"{path}: {data_size - covered} trailing bytes after the last tensor (the "
            f"tensors cover {covered} of {data_size} data bytes); the format requires "
            f"the tensors to tile the data section"
        )
    return tensors


class SafetensorsDir:
    """Every tensor of a checkpoint directory: `model.safetensors`, or the shards an index names, or
    (lacking both) every `*.safetensors` file in the directory. Nothing is read until `get`."""

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        index = self.dir / INDEX_NAME
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError) as e:
                raise SafetensorsError(f"{index}: not a valid safetensors index ({e!r})") from None
            files = sorted({self.dir / f for f in weight_map.values()})
        elif (self.dir / SINGLE_NAME).exists():
            files = [self.dir / SINGLE_NAME]
        else:
            files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise SafetensorsError(f"{self.dir}: no {SINGLE_NAME}, {INDEX_NAME} or *.safetensors file found")
        self.files = files
        self.tensors: dict[str, TensorInfo] = {}
        for path in files:
            if not path.exists():
                raise SafetensorsError(f"{index}: names shard {path.name!r}, which does not exist in {self.dir}")
            self.tensors.update(read_tensors(path))
        self._maps: dict[Path, np.memmap] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def keys(self) -> Iterable[str]:
        return self.tensors.keys()

    def info(self, name: str) -> TensorInfo:
        return self.tensors[name]

    def file_names(self) -> str:
        return ", ".join(p.name for p in self.files)

    def get(self, name: str) -> np.ndarray:
        """A read-only memory-mapped view of the tensor (slice it, then copy what you need)."""
        t = self.tensors[name]
        if t.dtype is None:
            raise SafetensorsError(
                f"{t.file}: tensor {name!r} is {t.code}, packed {BITS[t.code]} bits to an "
                f"element; readable dtypes: {', '.join(DTYPES)}"
            )
        mm = self._maps.get(t.file)
        if mm is None:
            mm = self._maps[t.file] = np.memmap(t.file, dtype=np.uint8, mode="r")
        return mm[t.offset : t.offset + t.nbytes].view(t.dtype).reshape(t.shape)


def _header_bytes(
    entries: list[tuple[str, np.dtype, tuple[int, ...]]], metadata: Mapping[str, str]
) -> tuple[bytes, int]:
    header: dict = {"__metadata__": dict(metadata)}
    offset = 0
    for name, dtype, shape in entries:
        if dtype not in CODES:
            raise SafetensorsError(
                f"cannot write tensor {name!r} of dtype {dtype}; writable: {', '.join(map(str, CODES))}"
            )
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[name] = {"dtype": CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data start aligned to 8 bytes, as the reference writer does
    return raw, offset


def write_file(
    path: str | os.PathLike,
    entries: list[tuple[str, np.dtype, tuple[int, ...]]],
    arrays: Iterator[np.ndarray],
    metadata: Mapping[str, str] | None = None,
) -> int:
    """Write one safetensors file tensor by tensor.

    entries: (name, dtype, shape) in file order, known before any data; arrays: yields each tensor's
    data in that order (so only one tensor needs to be on the host at a time). Returns the data size.
    """
    raw, total = _header_bytes(entries, metadata or {"format": "pt"})
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for (name, dtype, shape), arr in zip(entries, arrays, strict=True):
            arr = np.ascontiguousarray(arr)
            if arr.dtype != dtype or tuple(arr.shape) != tuple(shape):
                raise SafetensorsError(
                    f"tensor {name!r}: announced {dtype}{list(shape)}, got {arr.dtype}{list(arr.shape)}"
                )
            f.write(arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes())
    return total
