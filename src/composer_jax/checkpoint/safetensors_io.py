"""Lazy safetensors reading and streaming writing with numpy + ml_dtypes (no torch needed).

Format (https://github.com/huggingface/safetensors): 8-byte little-endian header length N, N bytes of
JSON `{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`, then the
tensor bytes (C order, little endian), offsets relative to the end of the header.

The `safetensors` package's numpy backend rejects bfloat16 and float8 tensors, which every DeepSeek /
Kimi checkpoint holds, so tensors are read through `np.memmap`: a slice of a tensor touches only the
pages it covers, and nothing is read before it is asked for.
"""
from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Iterable, Iterator, Mapping

import ml_dtypes
import numpy as np

# safetensors dtype code <-> numpy dtype
DTYPES: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
CODES: dict[np.dtype, str] = {v: k for k, v in DTYPES.items()}

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"


class SafetensorsError(ValueError):
    """A safetensors file or index is malformed or does not hold what it should."""


class TensorInfo:
    __slots__ = ("name", "file", "dtype", "shape", "offset")

    def __init__(self, name: str, file: Path, dtype: np.dtype, shape: tuple[int, ...], offset: int):
        self.name, self.file, self.dtype, self.shape, self.offset = name, file, dtype, shape, offset


def read_header(path: Path) -> tuple[dict, int]:
    """(header dict, byte offset where tensor data starts)."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise SafetensorsError(f"{path}: too short to be a safetensors file")
        (n,) = struct.unpack("<Q", raw)
        if n > 100 * 2**20:
            raise SafetensorsError(f"{path}: header length {n} is implausible; not a safetensors file?")
        try:
            header = json.loads(f.read(n))
        except json.JSONDecodeError as e:
            raise SafetensorsError(f"{path}: header is not valid JSON ({e})") from None
    return header, 8 + n


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
            header, start = read_header(path)
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                if meta["dtype"] not in DTYPES:
                    raise SafetensorsError(f"{path.name}: tensor {name!r} has dtype {meta['dtype']!r}; "
                                           f"readable dtypes: {', '.join(DTYPES)}")
                begin, _ = meta["data_offsets"]
                self.tensors[name] = TensorInfo(name, path, DTYPES[meta["dtype"]], tuple(meta["shape"]), start + begin)
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
        mm = self._maps.get(t.file)
        if mm is None:
            mm = self._maps[t.file] = np.memmap(t.file, dtype=np.uint8, mode="r")
        count = int(np.prod(t.shape, dtype=np.int64))
        flat = mm[t.offset: t.offset + count * t.dtype.itemsize].view(t.dtype)
        return flat.reshape(t.shape)


def _header_bytes(entries: list[tuple[str, np.dtype, tuple[int, ...]]], metadata: Mapping[str, str]) -> tuple[bytes, int]:
    header: dict = {"__metadata__": dict(metadata)}
    offset = 0
    for name, dtype, shape in entries:
        if dtype not in CODES:
            raise SafetensorsError(f"cannot write tensor {name!r} of dtype {dtype}; writable: {', '.join(map(str, CODES))}")
        size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        header[name] = {"dtype": CODES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # data start aligned to 8 bytes, as the reference writer does
    return raw, offset


def write_file(path: str | os.PathLike, entries: list[tuple[str, np.dtype, tuple[int, ...]]],
               arrays: Iterator[np.ndarray], metadata: Mapping[str, str] | None = None) -> int:
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
                raise SafetensorsError(f"tensor {name!r}: announced {dtype}{list(shape)}, got {arr.dtype}{list(arr.shape)}")
            f.write(arr.astype(arr.dtype.newbyteorder("<"), copy=False).tobytes())
    return total
