"""Our safetensors reader accepts exactly the files the reference reader (the `safetensors` package)
accepts, and reads the same bytes from them.

A small file is written by `safetensors.numpy.save_file`, then its header, offsets and bytes are
mutated (truncation, relabelled dtypes, offsets into another tensor, overlaps, gaps, trailing bytes,
non-UTF-8 / non-JSON headers, bad shapes...). For every mutated file the reference `safe_open` is the
oracle: where it rejects, `SafetensorsDir` must raise SafetensorsError naming the file (and the tensor,
where one tensor is at fault); where it accepts, every tensor must hold the reference's bytes.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from composer_jax.hf.safetensors_io import SafetensorsDir, SafetensorsError

safetensors = pytest.importorskip("safetensors")
from safetensors import SafetensorError, deserialize, safe_open  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

# a: F32 [2, 3] (24 bytes), b: I32 [2, 3] (24 bytes, the same size as a, so offsets can be swapped),
# c: F32 [1] (4 bytes)
ARRAYS = {
    "a": np.arange(6, dtype=np.float32).reshape(2, 3) + 0.5,
    "b": np.arange(100, 106, dtype=np.int32).reshape(2, 3),
    "c": np.array([-7.25], np.float32),
}
# dtypes the reference numpy backend returns (it has no bfloat16 / float8)
NUMPY_CODES = {"F64", "F32", "F16", "I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL"}


@dataclass
class File:
    """A safetensors file taken apart: the parsed header, the data section, and (when set) raw bytes
    that replace the header JSON or the whole file."""

    header: dict
    data: bytes
    header_raw: bytes | None = None
    whole: bytes | None = None
    header_len: int | None = None  # a length field that lies about the header

    def layout(self) -> list[str]:
        """Tensor names in data order."""
        return sorted((k for k in self.header if k != "__metadata__"), key=lambda k: self.header[k]["data_offsets"])

    def bytes(self) -> bytes:
        if self.whole is not None:
            return self.whole
        raw = self.header_raw if self.header_raw is not None else json.dumps(self.header).encode()
        n = len(raw) if self.header_len is None else self.header_len
        return struct.pack("<Q", n) + raw + self.data

    def shift_from(self, name: str, by: int) -> None:
        """Insert `by` zero bytes before tensor `name`'s data, moving it and every later tensor."""
        begin = self.header[name]["data_offsets"][0]
        self.data = self.data[:begin] + bytes(by) + self.data[begin:]
        for k in self.layout():
            b, e = self.header[k]["data_offsets"]
            if b >= begin:
                self.header[k]["data_offsets"] = [b + by, e + by]


def _set(name, key, value):
    def edit(f: File):
        f.header[name][key] = value

    return edit


def _offsets(name, fn):
    def edit(f: File):
        b, e = f.header[name]["data_offsets"]
        f.header[name]["data_offsets"] = list(fn(b, e))

    return edit


def _swap_offsets(x, y):
    def edit(f: File):
        f.header[x]["data_offsets"], f.header[y]["data_offsets"] = (
            f.header[y]["data_offsets"],
            f.header[x]["data_offsets"],
        )

    return edit


def _header_text(fn):
    def edit(f: File):
        f.header_raw = fn(json.dumps(f.header).encode())

    return edit


def _last(f: File) -> str:
    return f.layout()[-1]


def _second(f: File) -> str:
    return f.layout()[1]


def _first(f: File) -> str:
    return f.layout()[0]


def _trunc(k):
    def edit(f: File):
        f.data = f.data[:-k]

    return edit


def _truncate_file(n):
    def edit(f: File):
        f.whole = f.bytes()[:n]

    return edit


def _add_zero_size(f: File):
    end = f.header[_first(f)]["data_offsets"][1]  # between the first and second tensors
    f.header["z"] = {"dtype": "F32", "shape": [3, 0], "data_offsets": [end, end]}


def _scalar_c(f: File):
    f.header["c"]["shape"] = []


def _gap_between(f: File):
    f.shift_from(_second(f), 8)


def _gap_at_start(f: File):
    f.shift_from(_first(f), 4)


def _overlap_partial(f: File):
    # every tensor after the first moves 4 bytes back, into the first; the data section shrinks to
    # match, so only the overlap is wrong
    for k in f.layout()[1:]:
        b, e = f.header[k]["data_offsets"]
        f.header[k]["data_offsets"] = [b - 4, e - 4]
    f.data = f.data[:-4]


def _shift_last(by):
    def edit(f: File):
        b, e = f.header[_last(f)]["data_offsets"]
        f.header[_last(f)]["data_offsets"] = [b + by, e + by]

    return edit


def _reorder_keys(f: File):
    f.header = dict(reversed(list(f.header.items())))


def _drop_metadata(f: File):
    f.header.pop("__metadata__", None)


def _drop_all_tensors(f: File) -> None:
    f.header = {}
    f.data = b""


def _pad_header(f: File):
    raw = json.dumps(f.header).encode()
    f.header_raw = b"   " + raw + b" " * 13  # JSON whitespace around the object, as the writer pads


@dataclass
class Mutation:
    id: str
    edit: Callable[[File], None]
    accepted: bool  # what the reference reader does (checked too, so the table cannot drift)
    # the tensor(s) an error must name (one of them: an overlap is the fault of either side), or a
    # function of the file giving it; () where the fault is the file's, not a tensor's
    names: tuple[str, ...] | Callable[[File], str] = ()


MUTATIONS = [
    Mutation("unchanged", lambda f: None, True),
    Mutation("keys_reordered", _reorder_keys, True),
    Mutation("no_metadata", _drop_metadata, True),
    Mutation("header_padded_with_spaces", _pad_header, True),
    Mutation("extra_field_in_entry", _set("a", "note", "ignored"), True),
    Mutation("metadata_null", lambda f: f.header.update(__metadata__=None), True),
    Mutation("no_tensors", _drop_all_tensors, True),
    Mutation("no_tensors_but_data", lambda f: setattr(f, "header", {}), False),
    Mutation("offsets_of_same_size_tensors_swapped", _swap_offsets("a", "b"), True),
    Mutation("relabel_a_F32_to_I32", _set("a", "dtype", "I32"), True),
    Mutation("reshape_a_3x2", _set("a", "shape", [3, 2]), True),
    Mutation("zero_size_tensor_added", _add_zero_size, True),
    Mutation("c_made_scalar", _scalar_c, True),
    Mutation(
        "duplicate_key_same_entry",
        _header_text(lambda r: r[:-1] + b',"c":' + json.dumps(json.loads(r)["c"]).encode() + b"}"),
        True,
    ),
    # BF16 with twice the elements covers a's 24 bytes exactly: a valid (if meaningless) file
    Mutation("relabel_a_F32_to_BF16_shape_doubled", lambda f: f.header["a"].update(dtype="BF16", shape=[2, 6]), True),
    # truncation / file size
    Mutation("data_truncated_by_1_byte", _trunc(1), False, _last),
    Mutation("data_truncated_by_half", _trunc(26), False, _second),  # the cut (byte 26) is in the 2nd tensor
    Mutation("file_cut_inside_header", _truncate_file(30), False),
    Mutation("file_shorter_than_length_field", _truncate_file(5), False),
    Mutation("empty_file", _truncate_file(0), False),
    Mutation("trailing_bytes", lambda f: setattr(f, "data", f.data + bytes(8)), False),
    Mutation("header_length_larger_than_file", lambda f: setattr(f, "header_len", len(f.bytes()) + 100), False),
    Mutation("header_length_over_limit", lambda f: setattr(f, "header_len", 2**63), False),
    Mutation("header_length_short_by_1", lambda f: setattr(f, "header_len", len(json.dumps(f.header)) - 1), False),
    # header encoding / JSON
    Mutation("header_not_utf8", _header_text(lambda r: r.replace(b'"a"', b'"\xff"')), False),
    Mutation("header_utf16", _header_text(lambda r: r.decode().encode("utf-16")), False),
    Mutation("header_not_json", _header_text(lambda r: b"not json" + r[8:]), False),
    Mutation("header_json_array", _header_text(lambda r: b"[" + r + b"]"), False),
    Mutation("header_nul_padded", _header_text(lambda r: r + b"\0"), False),
    Mutation("header_nan_in_metadata", _header_text(lambda r: r.replace(b'"np"', b"NaN")), False),
    Mutation("name_lone_surrogate", _header_text(lambda r: r.replace(b'"a"', b'"\\ud800"')), False),
    Mutation("metadata_not_strings", lambda f: f.header.update(__metadata__={"format": 1}), False),
    Mutation("entry_not_object", lambda f: f.header.update(c=["F32", [1], [48, 52]]), False, ("c",)),
    Mutation("entry_missing_dtype", lambda f: f.header["a"].pop("dtype"), False, ("a",)),
    # dtype
    Mutation("relabel_a_F32_to_BF16", _set("a", "dtype", "BF16"), False, ("a",)),
    Mutation("relabel_a_F32_to_F16", _set("a", "dtype", "F16"), False, ("a",)),
    Mutation("relabel_a_F32_to_F64", _set("a", "dtype", "F64"), False, ("a",)),
    Mutation("relabel_c_F32_to_F4", _set("c", "dtype", "F4"), False, ("c",)),  # 4 bits x 1 not whole bytes
    Mutation("unknown_dtype", _set("a", "dtype", "F128"), False, ("a",)),
    Mutation("dtype_not_a_string", _set("a", "dtype", ["F32"]), False, ("a",)),
    Mutation("lowercase_dtype", _set("b", "dtype", "i32"), False, ("b",)),
    # shape
    Mutation("shape_negative", _set("a", "shape", [-2, -3]), False, ("a",)),
    Mutation("shape_float", _set("a", "shape", [2.0, 3]), False, ("a",)),
    Mutation("shape_bool", _set("c", "shape", [True]), False, ("c",)),
    Mutation("shape_string", _set("a", "shape", "2,3"), False, ("a",)),
    Mutation("shape_too_few_elements", _set("a", "shape", [2, 2]), False, ("a",)),
    Mutation("shape_too_many_elements", _set("b", "shape", [2, 4]), False, ("b",)),
    Mutation(
        "shape_overflows_u64_before_zero",
        lambda f: f.header.update(z={"dtype": "U8", "shape": [2**32, 2**32, 0], "data_offsets": [0, 0]}),
        False,
        ("z",),
    ),
    Mutation(
        "shape_dim_over_u64",
        lambda f: f.header.update(z={"dtype": "U8", "shape": [2**64, 0], "data_offsets": [0, 0]}),
        False,
        ("z",),
    ),
    # offsets
    Mutation("offsets_begin_after_end", _offsets("a", lambda b, e: (e, b)), False, ("a",)),
    Mutation("offsets_three_ints", _offsets("a", lambda b, e: (b, e, e)), False, ("a",)),
    Mutation("offsets_float", _set("a", "data_offsets", [0.0, 24.0]), False, ("a",)),
    Mutation("offsets_negative", _offsets("c", lambda b, e: (b - 64, e - 64)), False, ("c",)),
    Mutation("offsets_past_end", _shift_last(8), False, _last),
    Mutation("offsets_far_past_end", _shift_last(2**40), False, _last),
    Mutation(
        "a_points_into_b",
        lambda f: f.header["a"].update(data_offsets=list(f.header["b"]["data_offsets"])),
        False,
        ("a", "b"),
    ),
    Mutation(
        "c_points_into_a",
        lambda f: f.header["c"].update(
            data_offsets=[f.header["a"]["data_offsets"][0] + 4, f.header["a"]["data_offsets"][0] + 8]
        ),
        False,
        ("a", "c"),
    ),
    Mutation("overlap_partial", _overlap_partial, False, ("a", "b", "c")),
    Mutation("gap_between_tensors", _gap_between, False, _second),
    Mutation("gap_at_start", _gap_at_start, False, _first),
]


def _reference(path: Path) -> dict[str, tuple[str, list[int], bytes, np.ndarray | None]] | None:
    """The reference reader's view: name -> (dtype code, shape, bytes, numpy array where its numpy
    backend has the dtype); None where it rejects the file."""
    try:
        with safe_open(str(path), framework="np") as f:
            arrays = {k: f.get_tensor(k) if f.get_slice(k).get_dtype() in NUMPY_CODES else None for k in f.keys()}
    except SafetensorError:
        return None
    raw = dict(deserialize(path.read_bytes()))  # raw bytes for every dtype, bfloat16 included
    assert raw.keys() == arrays.keys()
    return {k: (raw[k]["dtype"], raw[k]["shape"], bytes(raw[k]["data"]), arrays[k]) for k in raw}


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[dict, bytes]:
    path = tmp_path_factory.mktemp("base") / "model.safetensors"
    save_file(ARRAYS, path, metadata={"format": "np"})
    blob = path.read_bytes()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8 : 8 + n]), blob[8 + n :]


@pytest.mark.parametrize("m", MUTATIONS, ids=lambda m: m.id)
def test_reader_agrees_with_reference(m: Mutation, base, tmp_path):
    header, data = base
    f = File(json.loads(json.dumps(header)), data)
    m.edit(f)
    path = tmp_path / "model.safetensors"
    path.write_bytes(f.bytes())

    ref = _reference(path)
    assert (ref is not None) == m.accepted, f"the reference reader {'accepts' if ref else 'rejects'} {m.id}"
    if ref is None:
        with pytest.raises(SafetensorsError) as e:
            SafetensorsDir(tmp_path)
        msg = str(e.value)
        assert str(path) in msg
        names = (m.names(f),) if callable(m.names) else m.names
        if names:
            assert any(repr(n) in msg for n in names), msg
        return

    ours = SafetensorsDir(tmp_path)
    assert sorted(ours.keys()) == sorted(ref)
    for name, (code, shape, raw, arr) in ref.items():
        info = ours.info(name)
        assert info.code == code and list(info.shape) == shape
        got = ours.get(name)
        assert got.shape == tuple(shape)
        assert got.tobytes() == raw
        if arr is not None:
            np.testing.assert_array_equal(got, arr)
            assert got.dtype == arr.dtype


def test_unchanged_file_holds_the_arrays_written(base, tmp_path):
    """An independent check of the accepting path: the bytes written come back as the same arrays."""
    header, data = base
    (tmp_path / "model.safetensors").write_bytes(File(header, data).bytes())
    ours = SafetensorsDir(tmp_path)
    for name, want in ARRAYS.items():
        np.testing.assert_array_equal(ours.get(name), want)
        assert ours.get(name).dtype == want.dtype


def test_relabelled_bf16_reads_as_bf16_halves(base, tmp_path):
    """F32 bytes relabelled BF16 [2, 6]: each float32 splits into its low and high 16-bit halves
    (little endian), and the high half is the float32 truncated to bfloat16."""
    header, data = base
    f = File(json.loads(json.dumps(header)), data)
    f.header["a"].update(dtype="BF16", shape=[2, 6])
    (tmp_path / "model.safetensors").write_bytes(f.bytes())
    got = SafetensorsDir(tmp_path).get("a")
    # a = 0.5, 1.5, ... 5.5: exact in bfloat16 (few mantissa bits), and their low halves are zero
    np.testing.assert_array_equal(got.astype(np.float32).reshape(6, 2)[:, 1], ARRAYS["a"].reshape(-1))
    np.testing.assert_array_equal(got.astype(np.float32).reshape(6, 2)[:, 0], 0)


def test_packed_dtype_is_checked_but_not_returned(tmp_path):
    """F4 (two to a byte) is a valid header, as the reference reader says, but not a numpy array."""
    h = json.dumps({"q": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]}}).encode()
    path = tmp_path / "model.safetensors"
    path.write_bytes(struct.pack("<Q", len(h)) + h + b"\x12\x34")
    assert _reference(path) is not None
    ours = SafetensorsDir(tmp_path)
    assert ours.info("q").nbytes == 2
    with pytest.raises(SafetensorsError, match=r"tensor 'q' is F4, packed 4 bits.*readable dtypes: F64"):
        ours.get("q")
