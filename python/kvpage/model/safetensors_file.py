"""A minimal, strict reader for the ``.safetensors`` file format (memory-mapped, no pickle).

The ``safetensors`` package's numpy backend cannot return bfloat16, so this file parses the
format directly: an 8-byte little-endian header length, a JSON header mapping each tensor
name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the end
of the header), then the raw little-endian data. bfloat16 comes back as ``ml_dtypes``'s
numpy dtype. Every inconsistency raises :class:`CheckpointError` naming the file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import ml_dtypes
import numpy as np

from kvpage.model.errors import CheckpointError

_MAX_HEADER_BYTES = 100 * 1024 * 1024

_DTYPES: dict[str, np.dtype[Any]] = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype("<i8"),
    "I32": np.dtype("<i4"),
    "I16": np.dtype("<i2"),
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}


class SafetensorsFile:
    """The tensors of one ``.safetensors`` file, read lazily through a memory map."""

    __slots__ = ("path", "_entries", "_data_start", "_mmap")

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise CheckpointError(f"weight file not found: {self.path}")
        size = self.path.stat().st_size
        with self.path.open("rb") as f:
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"malformed safetensors file {self.path}: too short")
            header_len = int.from_bytes(prefix, "little")
            if header_len <= 0 or header_len > min(_MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(
                    f"malformed safetensors file {self.path}: bad header length {header_len}"
                )
            raw = f.read(header_len)
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CheckpointError(
                f"malformed safetensors file {self.path}: header is not JSON ({exc})"
            ) from exc
        if not isinstance(header, dict):
            raise CheckpointError(f"malformed safetensors file {self.path}: header not an object")
        header.pop("__metadata__", None)
        self._data_start = 8 + header_len
        data_size = size - self._data_start
        self._entries: dict[str, tuple[np.dtype[Any], tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            self._entries[name] = self._parse_entry(name, info, data_size)
        self._mmap: np.memmap[Any, np.dtype[np.uint8]] | None = None

    def _parse_entry(
        self, name: str, info: Any, data_size: int
    ) -> tuple[np.dtype[Any], tuple[int, ...], int, int]:
        where = f"safetensors file {self.path}, tensor {name!r}"
        try:
            dtype_name, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
            shape = tuple(int(s) for s in shape)
            begin, end = int(begin), int(end)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"malformed {where}: bad header entry {info!r}") from exc
        if dtype_name not in _DTYPES:
            raise CheckpointError(f"unsupported dtype {dtype_name!r} in {where}")
        dtype = _DTYPES[dtype_name]
        nbytes = math.prod(shape) * dtype.itemsize
        if begin < 0 or end < begin or end > data_size or end - begin != nbytes:
            raise CheckpointError(
                f"malformed {where}: data offsets [{begin}, {end}) do not fit shape {shape} "
                f"{dtype_name} in {data_size} data bytes"
            )
        return dtype, shape, begin, end

    def keys(self) -> list[str]:
        return list(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def shape(self, name: str) -> tuple[int, ...]:
        return self._entries[name][1]

    def dtype(self, name: str) -> np.dtype[Any]:
        return self._entries[name][0]

    def get(self, name: str) -> np.ndarray[Any, Any]:
        """A read-only array view of tensor ``name`` (no copy until used)."""
        if name not in self._entries:
            raise CheckpointError(f"tensor {name!r} not found in {self.path}")
        dtype, shape, begin, end = self._entries[name]
        if self._mmap is None:
            self._mmap = np.memmap(self.path, dtype=np.uint8, mode="r")
        start = self._data_start + begin
        return self._mmap[start : self._data_start + end].view(dtype).reshape(shape)
