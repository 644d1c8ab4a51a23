"""Reading one GGUF file's metadata: opening it, and typed access to its fields.

This file owns how a metadata value is read: every value is type-checked where it is
read, and a wrong type or a missing required key is a :class:`CheckpointError` naming
the file and the key (the container itself, lengths, offsets and bounds, is checked by
:mod:`kvpage.model.gguf_file`). Used by the model loader (:mod:`.gguf_loader`) and the
tokenizer builder (:mod:`.gguf_tokenizer`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from kvpage.model.errors import CheckpointError
from kvpage.model.gguf_file import GGUFArray, GGUFFile, value_type_name

GGUF_SUFFIX = ".gguf"
_MAGIC = b"GGUF"
# The most tokens (and merges, and elements of any tokenizer array) a file may declare:
# ModelConfig's bound on vocab_size. Decoding is bounded before it starts.
MAX_VOCAB = 1 << 22


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file (by its ``.gguf`` suffix or its magic bytes)."""
    path = Path(path)
    if path.is_dir():
        return False
    if path.suffix.lower() == GGUF_SUFFIX or not path.is_file():
        return path.suffix.lower() == GGUF_SUFFIX
    with path.open("rb") as f:
        return f.read(4) == _MAGIC


def open_gguf(path: str | Path) -> GGUFFile:
    """The file's metadata and tensor index (:mod:`kvpage.model.gguf_file`, which checks
    the container: lengths, offsets, alignment, tensor bounds); every way the file can be
    unreadable is a :class:`CheckpointError` naming it."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file not found: {path}")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != _MAGIC:
        raise CheckpointError(
            f"{path} is not a GGUF file (it starts with {magic!r}, not {_MAGIC!r})"
        )
    return GGUFFile(path)


def field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    """One metadata value as a Python scalar or string, or a
    :class:`~kvpage.model.gguf_file.GGUFArray` (``default`` if absent)."""
    return reader.fields.get(key, default)


def describe(value: Any) -> str:
    if isinstance(value, GGUFArray):
        return f"an array of {len(value)} {value_type_name(value.element_type)}"
    return f"{type(value).__name__} {value!r:.60}"


def int_field(reader: GGUFFile, key: str, path: Path, default: int | None = None) -> int | None:
    """An integer metadata value (``default`` if absent); any other type is a
    :class:`CheckpointError` naming the key."""
    value = field(reader, key, default)
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise CheckpointError(f"GGUF file {path}: metadata {key!r} is {describe(value)}, "
                          "not an integer")


def float_field(reader: GGUFFile, key: str, path: Path, default: float) -> float:
    """A finite number from the metadata (``default`` if absent)."""
    value = field(reader, key, default)
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    raise CheckpointError(f"GGUF file {path}: metadata {key!r} is {describe(value)}, "
                          "not a finite number")


def required_int(reader: Any, key: str, path: Path) -> int:
    value = int_field(reader, key, path)
    if value is None:
        raise CheckpointError(f"GGUF file {path} lacks the integer metadata {key!r}")
    return value


def tensor_shape(tensor: Any) -> tuple[int, ...]:
    """The HF/numpy shape (GGUF lists dimensions fastest-varying first)."""
    return tuple(int(d) for d in reversed(tuple(tensor.shape)))
