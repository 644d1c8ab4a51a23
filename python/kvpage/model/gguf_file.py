"""A GGUF file's metadata and tensor index, read in one pass over its header.

This file owns the parsing of GGUF's container format (version 2 and 3): the key/value
metadata and the tensor index, whose data are zero-copy views of a read-only memory map.
``gguf.GGUFReader`` builds a numpy view per metadata element, about 5 s for SmolLM2's
49k-token vocabulary on this CPU; this reads the same header in a few ms, because
metadata arrays are only walked, not decoded (:class:`GGUFArray`).

Layout (little-endian): ``"GGUF"``, u32 version, u64 tensor count, u64 key/value count;
each key/value: a string key (u64 length + UTF-8), a u32 value type, the value (an array
is a u32 element type, a u64 count, the elements); each tensor: a string name, u32 number
of dims, u64 dims (fastest-varying first), u32 ggml type, u64 offset into the data
section, which starts at the next multiple of ``general.alignment`` (default 32).

Invariants, each checked while parsing and before anything is allocated for it:

* every declared length (a string's bytes, an array's elements, the key and tensor
  counts, a tensor's bytes) is checked against the bytes left in the file first;
* at most ``MAX_FIELDS`` keys, all distinct, and ``MAX_TENSORS`` tensors;
* a metadata array is not decoded while parsing: it is a :class:`GGUFArray` (element type,
  length, place in the file) whose structure has been checked, decoded only when asked
  for, so an array nobody reads costs no memory; arrays nest at most
  ``MAX_ARRAY_DEPTH`` deep;
* ``general.alignment`` is an integer power of two, at most ``MAX_ALIGNMENT``;
* every tensor has a distinct name, at most ``MAX_DIMS`` dims, each >= 1, fewer than
  2**63 elements, a known ggml type whose block size divides its first dim, an offset
  that is a multiple of the alignment, and bytes inside the file that no other tensor's
  bytes overlap.

Every malformed or truncated file raises :class:`CheckpointError` naming the file, the
key or tensor being read and the byte offset; anything else the parse trips on
(``IndexError``, ``struct.error``, ``OverflowError``, ``MemoryError``, ...) is turned
into one too.
"""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from kvpage.model.errors import CheckpointError

MAX_FIELDS = 1 << 16
MAX_TENSORS = 1 << 16
MAX_ARRAY_DEPTH = 8
MAX_ALIGNMENT = 1 << 24
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
ALIGNMENT_KEY = "general.alignment"

_MAGIC = b"GGUF"
_VERSIONS = (2, 3)
_STRING, _ARRAY = 8, 9
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")
_SCALARS: dict[int, struct.Struct] = {
    kind: struct.Struct(fmt)
    for kind, fmt in {
        0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q",
        11: "<q", 12: "<d",
    }.items()
}
_TYPE_NAMES = {
    0: "UINT8", 1: "INT8", 2: "UINT16", 3: "INT16", 4: "UINT32", 5: "INT32", 6: "FLOAT32",
    7: "BOOL", 8: "STRING", 9: "ARRAY", 10: "UINT64", 11: "INT64", 12: "FLOAT64",
}
# The fewest bytes one key/value (empty key, u8 value) and one tensor info (empty name,
# no dims) can take: the counts in the header are bounded by what the file can hold.
_MIN_FIELD_BYTES = 8 + 4 + 1
_MIN_TENSOR_BYTES = 8 + 4 + 4 + 8
_MIN_ELEMENT_BYTES = {_STRING: 8, _ARRAY: 4 + 8}
_MAX_ELEMENTS = (1 << 63) - 1
_TYPED_DATA = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
               "I16": np.int16, "I32": np.int32, "I64": np.int64}
# What the parse can trip on besides its own checks; each becomes a CheckpointError.
_PARSE_ERRORS = (
    ValueError, LookupError, TypeError, ArithmeticError, struct.error, MemoryError,
    RecursionError,
)


def value_type_name(kind: int) -> str:
    """A GGUF metadata value type's name (``"UINT32"``, ...)."""
    return _TYPE_NAMES.get(kind, f"unknown type {kind}")


class GGUFTensor(NamedTuple):
    name: str
    shape: tuple[int, ...]
    """GGUF order: fastest-varying dimension first."""
    tensor_type: Any
    """``gguf.GGMLQuantizationType``."""
    n_bytes: int
    data_offset: int
    data: np.ndarray
    """As ``gguf.GGUFReader`` shapes it: typed values for float/int types, raw block
    bytes (``[..., bytes per row]``) for quantized ones."""


class GGUFArray:
    """One metadata array, checked but not decoded: where its elements lie in the file.

    ``len()`` is free; :meth:`numpy` is a zero-copy view (numbers only); :meth:`tolist`
    decodes every element (strings as ``str``, nested arrays as lists), so a caller
    bounds ``len()`` before asking for it.
    """

    __slots__ = ("key", "element_type", "_count", "_start", "_buf", "_path")

    def __init__(self, buf: memoryview, path: Path, key: str, element_type: int, count: int,
                 start: int) -> None:
        self.key = key
        self.element_type = element_type
        self._count = count
        self._start = start
        self._buf = buf
        self._path = path

    def __len__(self) -> int:
        return self._count

    def __repr__(self) -> str:
        return f"GGUFArray({self.key!r}, {value_type_name(self.element_type)}, {self._count})"

    @property
    def numeric(self) -> bool:
        """Whether the elements are numbers (or bools), so :meth:`numpy` applies."""
        return self.element_type in _SCALARS

    @property
    def strings(self) -> bool:
        """Whether the elements are strings."""
        return self.element_type == _STRING

    def numpy(self) -> np.ndarray:
        """The elements as a read-only numpy view of the file (numeric arrays only)."""
        if not self.numeric:
            raise CheckpointError(
                f"GGUF file {self._path}: metadata {self.key!r} is an array of "
                f"{value_type_name(self.element_type)}, not of numbers"
            )
        dtype = np.dtype(_SCALARS[self.element_type].format)
        return np.frombuffer(self._buf, dtype, self._count, self._start)

    def tolist(self) -> list[Any]:
        """Every element as a Python value (``int``, ``float``, ``bool``, ``str`` or, for
        nested arrays, ``list``)."""
        if self.numeric:
            values: list[Any] = self.numpy().tolist()
            return values
        values, _ = _decode(self._buf, self._path, self.key, self.element_type, self._count,
                            self._start)
        return values


def _decode(buf: memoryview, path: Path, key: str, element: int, count: int, pos: int
            ) -> tuple[list[Any], int]:
    """The elements of an array whose structure the parse has checked, and the offset
    just past them."""
    if element in _SCALARS:
        dtype = np.dtype(_SCALARS[element].format)
        values = np.frombuffer(buf, dtype, count, pos).tolist()
        return values, pos + dtype.itemsize * count
    if element == _ARRAY:
        nested = []
        for _ in range(count):
            inner, n = _U32.unpack_from(buf, pos)[0], _U64.unpack_from(buf, pos + 4)[0]
            values, pos = _decode(buf, path, key, inner, n, pos + 12)
            nested.append(values)
        return nested, pos
    strings: list[str] = []
    append, unpack = strings.append, _U64.unpack_from
    try:
        for _ in range(count):
            (length,) = unpack(buf, pos)
            pos += 8
            append(buf[pos : pos + length].tobytes().decode("utf-8"))
            pos += length
    except UnicodeDecodeError as exc:
        raise CheckpointError(
            f"malformed GGUF file {path}: metadata {key!r}, element {len(strings)} (byte "
            f"{pos}): not UTF-8 ({exc.reason} at its byte {exc.start})"
        ) from None
    return strings, pos


class _Reader:
    """A position in the file's bytes; every read checks the bytes left first."""

    def __init__(self, buf: memoryview, path: Path) -> None:
        self.buf = buf
        self.size = len(buf)
        self.pos = 0
        self.path = path
        self.what = "the header"

    def fail(self, problem: str, at: int | None = None) -> CheckpointError:
        at = self.pos if at is None else at
        return CheckpointError(f"malformed GGUF file {self.path}: {self.what}, at byte {at}: "
                               f"{problem}")

    def need(self, n_bytes: int, item: str) -> None:
        left = self.size - self.pos
        if n_bytes > left:
            raise self.fail(f"{item} needs {n_bytes} bytes, only {left} are left (the file "
                            "is truncated?)")

    def u32(self, item: str) -> int:
        self.need(4, item)
        (value,) = _U32.unpack_from(self.buf, self.pos)
        self.pos += 4
        return int(value)

    def u64(self, item: str) -> int:
        self.need(8, item)
        (value,) = _U64.unpack_from(self.buf, self.pos)
        self.pos += 8
        return int(value)

    def count(self, item: str, min_bytes: int, limit: int) -> int:
        """A u64 count of things taking at least ``min_bytes`` each, at most ``limit``."""
        at = self.pos
        n = self.u64(f"the {item} count")
        if n > limit:
            raise self.fail(f"declares {n} {item}, more than the {limit} supported", at)
        left = self.size - self.pos
        if n * min_bytes > left:
            raise self.fail(f"declares {n} {item} (at least {n * min_bytes} bytes), only "
                            f"{left} bytes are left (the file is truncated?)", at)
        return n

    def string(self, item: str) -> str:
        length = self.u64(f"the length of {item}")
        self.need(length, item)
        start = self.pos
        self.pos += length
        try:
            return self.buf[start : self.pos].tobytes().decode("utf-8")
        except UnicodeDecodeError as exc:
            raise self.fail(f"{item} is not UTF-8 ({exc.reason} at its byte {exc.start})",
                            start) from None

    def value(self, kind: int, key: str) -> Any:
        fmt = _SCALARS.get(kind)
        if fmt is not None:
            self.need(fmt.size, f"a {value_type_name(kind)} value")
            (value,) = fmt.unpack_from(self.buf, self.pos)
            self.pos += fmt.size
            return value
        if kind == _STRING:
            return self.string("the string value")
        if kind == _ARRAY:
            element = self.u32("the array's element type")
            count = self.u64("the array's length")
            start = self.pos
            self.skip_elements(element, count, depth=1)
            return GGUFArray(self.buf, self.path, key, element, count, start)
        raise self.fail(f"unknown value type {kind}", self.pos - 4)

    def skip_elements(self, element: int, count: int, depth: int) -> None:
        """Move past ``count`` array elements of type ``element``, checking every length
        they declare against the bytes left, without decoding them."""
        fmt = _SCALARS.get(element)
        min_bytes = fmt.size if fmt is not None else _MIN_ELEMENT_BYTES.get(element)
        if min_bytes is None:
            raise self.fail(f"an array of unknown element type {element}")
        left = self.size - self.pos
        if count * min_bytes > left:
            raise self.fail(f"an array of {count} {value_type_name(element)} needs at least "
                            f"{count * min_bytes} bytes, only {left} are left (the file is "
                            "truncated?)")
        if fmt is not None:
            self.pos += count * min_bytes
        elif element == _STRING:
            self.skip_strings(count)
        else:
            if depth >= MAX_ARRAY_DEPTH:
                raise self.fail(f"arrays nest more than {MAX_ARRAY_DEPTH} deep")
            for _ in range(count):
                inner = self.u32("a nested array's element type")
                n = self.u64("a nested array's length")
                self.skip_elements(inner, n, depth + 1)

    def skip_strings(self, count: int) -> None:
        buf, pos, size, unpack = self.buf, self.pos, self.size, _U64.unpack_from
        for index in range(count):
            if pos + 8 > size:
                raise self.fail(f"string {index} of {count}: its length runs past the end of "
                                "the file (truncated?)", pos)
            end = pos + 8 + unpack(buf, pos)[0]
            if end > size:
                raise self.fail(f"string {index} of {count} ({end - pos - 8} bytes) runs "
                                f"past the end of the file at byte {size} (truncated?)", pos)
            pos = end
        self.pos = pos


class GGUFFile:
    """``fields``: metadata key -> value (``int``, ``float``, ``bool``, ``str`` or
    :class:`GGUFArray`); ``tensors``: :class:`GGUFTensor` in file order."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.fields: dict[str, Any] = {}
        self.tensors: list[GGUFTensor] = []
        self.alignment = DEFAULT_ALIGNMENT
        if self.path.stat().st_size == 0:
            raise CheckpointError(f"malformed GGUF file {self.path}: it is empty")
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        reader = _Reader(memoryview(self._map), self.path)
        try:
            infos = self._read_header(reader)
            self._index_tensors(reader, infos)
        except CheckpointError:
            raise
        except _PARSE_ERRORS as exc:  # a safety net: the checks above should come first
            raise CheckpointError(
                f"malformed GGUF file {self.path}: {reader.what}, at byte {reader.pos}: "
                f"{type(exc).__name__}: {exc}"
            ) from None

    def _read_header(self, reader: _Reader) -> list[tuple[str, tuple[int, ...], int, int]]:
        """The metadata (into ``fields``) and the raw tensor infos."""
        reader.need(4, "the magic")
        if bytes(reader.buf[:4]) != _MAGIC:
            raise reader.fail(f"not a GGUF file (it starts with {bytes(reader.buf[:4])!r})")
        reader.pos = 4
        version = reader.u32("the version")
        if version not in _VERSIONS:
            raise reader.fail(f"GGUF version {version} is not supported (2 and 3 are)", 4)
        num_tensors = reader.count("tensors", _MIN_TENSOR_BYTES, MAX_TENSORS)
        num_fields = reader.count("keys", _MIN_FIELD_BYTES, MAX_FIELDS)
        for index in range(num_fields):
            reader.what = f"key #{index}"
            key = reader.string("the key")
            reader.what = f"key #{index} {key!r}"
            if key in self.fields:
                raise reader.fail("the key appears twice")
            self.fields[key] = reader.value(reader.u32("the value type"), key)
        reader.what = "the tensor index"
        self.alignment = self._check_alignment(reader)
        infos = []
        for index in range(num_tensors):
            reader.what = f"tensor #{index}"
            name = reader.string("the tensor name")
            reader.what = f"tensor #{index} {name!r}"
            n_dims = reader.u32("the number of dims")
            if n_dims > MAX_DIMS:
                raise reader.fail(f"{n_dims} dims, more than {MAX_DIMS}", reader.pos - 4)
            reader.need(8 * n_dims, f"{n_dims} dims")
            dims = tuple(reader.u64("a dim") for _ in range(n_dims))
            if not all(dims):
                raise reader.fail(f"a dim is 0 (dims {dims})", reader.pos - 8 * n_dims)
            infos.append((name, dims, reader.u32("the tensor type"), reader.u64("the offset")))
        return infos

    def _check_alignment(self, reader: _Reader) -> int:
        alignment = self.fields.get(ALIGNMENT_KEY, DEFAULT_ALIGNMENT)
        reader.what = f"metadata {ALIGNMENT_KEY!r}"
        if not isinstance(alignment, int) or isinstance(alignment, bool):
            raise reader.fail(f"the alignment must be an integer, not {alignment!r}")
        if not 0 < alignment <= MAX_ALIGNMENT or alignment & (alignment - 1):
            raise reader.fail(f"the alignment {alignment} is not a power of two in "
                              f"[1, {MAX_ALIGNMENT}]")
        return alignment

    def _index_tensors(self, reader: _Reader,
                       infos: list[tuple[str, tuple[int, ...], int, int]]) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        alignment, size = self.alignment, reader.size
        start = -(-reader.pos // alignment) * alignment
        kinds = {int(kind): kind for kind in GGML_QUANT_SIZES}
        spans: list[tuple[int, int, str]] = []
        seen: set[str] = set()
        for index, (name, dims, raw_type, offset) in enumerate(infos):
            reader.what = f"tensor #{index} {name!r}"
            if name in seen:
                raise reader.fail("the tensor name appears twice", start)
            seen.add(name)
            kind = kinds.get(raw_type)
            if kind is None:
                raise reader.fail(f"unknown ggml type {raw_type}", start)
            block, type_size = GGML_QUANT_SIZES[kind]
            count = math.prod(dims)
            if count > _MAX_ELEMENTS:
                raise reader.fail(f"dims {dims} hold {count} elements, more than 2**63 - 1",
                                  start)
            row = dims[0] if dims else 1
            if row % block:
                raise reader.fail(f"type {kind.name} stores blocks of {block} values; the "
                                  f"first dim {row} is not a multiple", start)
            if offset % alignment:
                raise reader.fail(f"offset {offset} is not a multiple of the alignment "
                                  f"{alignment}", start)
            n_bytes = count // block * type_size
            data_offset = start + offset
            if data_offset + n_bytes > size:
                raise reader.fail(f"its {n_bytes} bytes at offset {offset} (bytes "
                                  f"{data_offset} to {data_offset + n_bytes}) run past the "
                                  f"end of the file at {size} (the file is truncated?)",
                                  data_offset)
            spans.append((data_offset, data_offset + n_bytes, name))
            raw = self._map[data_offset : data_offset + n_bytes]
            np_dims = tuple(reversed(dims))
            typed = _TYPED_DATA.get(kind.name)
            if typed is not None:
                data = raw.view(typed).reshape(np_dims)
            else:
                data = raw.reshape(quant_shape_to_byte_shape(np_dims, kind))
            self.tensors.append(GGUFTensor(name, dims, GGMLQuantizationType(kind), n_bytes,
                                           data_offset, data))
        spans.sort()
        for (_, end, first), (begin, _, second) in zip(spans, spans[1:], strict=False):
            if begin < end:
                reader.what = f"tensor {second!r}"
                raise reader.fail(f"its bytes overlap those of tensor {first!r} (which end at "
                                  f"{end})", begin)
