"""A GGUF file's metadata and tensor index, read in one pass over its header.

This file owns the parsing of GGUF's container format (version 2 and 3): the key/value
metadata, decoded to plain Python values, and the tensor index, whose data are zero-copy
views of a read-only memory map. ``gguf.GGUFReader`` builds a numpy view per metadata
element, about 5 s for SmolLM2's 49k-token vocabulary on this CPU; this reads the same
header in ~0.1 s, so a warm start is not spent parsing strings.

Layout (little-endian): ``"GGUF"``, u32 version, u64 tensor count, u64 key/value count;
each key/value: a string key (u64 length + UTF-8), a u32 value type, the value (an array
is a u32 element type, a u64 count, the elements); each tensor: a string name, u32 number
of dims, u64 dims (fastest-varying first), u32 ggml type, u64 offset into the data
section, which starts at the next multiple of ``general.alignment`` (default 32).

Every malformed or truncated header is a ``ValueError`` naming the offset.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

_MAGIC = b"GGUF"
_STRING, _ARRAY = 8, 9
_SCALARS: dict[int, str] = {
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
    12: "<d",
}
_TYPED_DATA = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "I8": np.int8,
               "I16": np.int16, "I32": np.int32, "I64": np.int64}


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


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise ValueError(
                f"the header ends at byte {len(self.buf)}, inside a value at {self.pos}"
            )
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        length = self.unpack("<Q")
        end = self.pos + length
        if end > len(self.buf):
            raise ValueError(f"a string of {length} bytes at {self.pos} runs past the file")
        text = bytes(self.buf[self.pos : end]).decode("utf-8")
        self.pos = end
        return text

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            element, count = self.unpack("<I"), self.unpack("<Q")
            return self.array(element, count)
        fmt = _SCALARS.get(kind)
        if fmt is None:
            raise ValueError(f"unknown GGUF value type {kind} at byte {self.pos}")
        return self.unpack(fmt)

    def array(self, element: int, count: int) -> list[Any]:
        fmt = _SCALARS.get(element)
        if fmt is not None:  # numbers: one frombuffer for the whole array
            dtype = np.dtype(fmt)
            end = self.pos + dtype.itemsize * count
            if end > len(self.buf):
                raise ValueError(f"an array of {count} values at {self.pos} runs past the file")
            values = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
            self.pos = end
            return values
        if element == _STRING:
            return [self.string() for _ in range(count)]
        return [self.value(element) for _ in range(count)]  # arrays of arrays


class GGUFFile:
    """``fields``: metadata key -> value (int, float, bool, str or list);
    ``tensors``: :class:`GGUFTensor` in file order."""

    def __init__(self, path: str | Path) -> None:
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
        from gguf.quants import quant_shape_to_byte_shape

        self.path = Path(path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        cursor = _Cursor(memoryview(self._map))
        if bytes(cursor.buf[:4]) != _MAGIC:
            raise ValueError("not a GGUF file (bad magic)")
        cursor.pos = 4
        version = cursor.unpack("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} is not supported (2 and 3 are)")
        num_tensors, num_fields = cursor.unpack("<Q"), cursor.unpack("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = cursor.string()
            self.fields[key] = cursor.value(cursor.unpack("<I"))
        infos = []
        for _ in range(num_tensors):
            name = cursor.string()
            dims = tuple(cursor.unpack("<Q") for _ in range(cursor.unpack("<I")))
            infos.append((name, dims, cursor.unpack("<I"), cursor.unpack("<Q")))
        alignment = int(self.fields.get("general.alignment", 32))
        start = -(-cursor.pos // alignment) * alignment
        self.tensors: list[GGUFTensor] = []
        seen: set[str] = set()
        for name, dims, raw_type, offset in infos:
            if name in seen:
                raise ValueError(f"tensor {name!r} appears twice")
            seen.add(name)
            kind = GGMLQuantizationType(raw_type)
            block, type_size = GGML_QUANT_SIZES[kind]
            count = int(np.prod(dims))
            n_bytes = count * type_size // block
            data_offset = start + offset
            raw = self._map[data_offset : data_offset + n_bytes]
            np_dims = tuple(reversed(dims))
            typed = _TYPED_DATA.get(kind.name)
            if len(raw) != n_bytes:
                data = raw  # truncated: the loader reports it with the sizes
            elif typed is not None:
                data = raw.view(typed).reshape(np_dims)
            else:
                data = raw.reshape(quant_shape_to_byte_shape(np_dims, kind))
            self.tensors.append(GGUFTensor(name, dims, kind, n_bytes, data_offset, data))
