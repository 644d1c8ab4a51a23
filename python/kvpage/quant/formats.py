"""The quantized weight formats, as the one table that owns them records them.

The table is ``FORMATS`` in ``rust/kernels/quant/formats.rs`` (Rust's ``QuantType``):
each format's name, weights and bytes per block, whether its rows carry a float
scale, its GGUF type name, and its code (its row's index). ``kvpage._core.quant_formats()``
hands it over and this module only reshapes it: no format's numbers are written in
Python. A leaf of :mod:`kvpage.quant`: it imports nothing from the package, and
``weights.py``, ``gguf_blocks.py``, ``modes.py`` and ``kernels/host/cpu_qmatmul.py`` read
their formats from here.

* :data:`KINDS`: the format names in the order of their codes (``QuantType::ALL``), also
  the suffixes of the FFI targets ``kvpage_qmatmul_<kind>`` and ``kvpage_dequantize_<kind>``.
* :data:`BLOCK_LAYOUTS`: name -> ``(weights per block, bytes per block)``. int8
  (per-channel, kvpage's own) is recorded as Rust records it, a block of 32 ``int8``
  weights in 32 bytes, so its rows hold a multiple of 32 weights, as the kernels need.
* :data:`ROW_SCALED`: the formats whose rows carry one float32 scale each (int8).
* :data:`GGUF_KEPT`: GGUF tensor type name -> format name, for the formats a GGUF file
  stores and kvpage keeps in their blocks.
"""

from __future__ import annotations

from kvpage import _core

_TABLE = _core.quant_formats()  # (code, name, elems, bytes, row_scaled, gguf), by code

KINDS: tuple[str, ...] = tuple(name for _, name, *_ in _TABLE)
BLOCK_LAYOUTS: dict[str, tuple[int, int]] = {
    name: (elems, size) for _, name, elems, size, _, _ in _TABLE
}
ROW_SCALED: frozenset[str] = frozenset(name for _, name, _, _, scaled, _ in _TABLE if scaled)
GGUF_KEPT: dict[str, str] = {gguf: name for _, name, _, _, _, gguf in _TABLE if gguf is not None}


def row_bytes(kind: str, inner: int) -> int:
    """Bytes of one stored row of ``inner`` weights (ValueError if ``inner`` is not a
    positive multiple of the format's block)."""
    elems, size = BLOCK_LAYOUTS[kind]
    if inner <= 0 or inner % elems:
        raise ValueError(f"{kind} weights need rows of a multiple of {elems} values, got {inner}")
    return inner // elems * size
