"""A quantized ``[out, in]`` linear weight (or ``[experts, out, in]`` stacked experts) as
one node of the params pytree.

Owns :class:`QuantizedWeight`: the stored arrays (GGUF's blocks as ``uint8 [out,
row_bytes]``, or int8 values ``[out, in]`` with float32 ``row_scales [out]``) as pytree
children, and the format, logical shape and compute dtype as static data, so a traced
step sees the format and jit, ``device_put`` and shardings treat the arrays as any
other leaves. ``shape`` and ``dtype`` are the float weight's, so code that sizes
activations from a weight (hidden size, dtype) works unchanged.

Invariant: ``blocks.shape == (*lead, row_bytes(kind, in))`` for a weight of shape
``(*lead, in)`` (int8: ``(*lead, in)``, ``in`` a multiple of 32, with
``row_scales.shape == lead``), ``lead`` one axis ``(out,)`` or two ``(experts, out)``;
checked at construction from
concrete arrays. The formats' layouts are :mod:`kvpage.quant.formats`' (owned by
``rust/kernels/quant/formats.rs``). ``layout`` says how the blocks are ordered: ``"rows"``
(GGUF's, each weight row's blocks in turn) or ``"tiles16"`` (Q4_0 or Q4_1 packed for the
CPU kernel, :mod:`kvpage.quant.tiles`); the blocks' shape is the same either way.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvpage.quant.formats import BLOCK_LAYOUTS, KINDS, ROW_SCALED, row_bytes
from kvpage.quant.gguf_blocks import dequantize_blocks
from kvpage.quant.tiles import PACKED_KINDS, unpack_tiles


@jax.tree_util.register_pytree_node_class
class QuantizedWeight:
    """An ``[out, in]`` (or ``[experts, out, in]``) weight in format ``kind`` (see
    :data:`KINDS`)."""

    __slots__ = ("blocks", "row_scales", "kind", "shape", "dtype", "layout")

    def __init__(
        self,
        blocks: Any,
        kind: str,
        shape: tuple[int, ...],
        dtype: Any = jnp.float32,
        row_scales: Any = None,
        layout: str = "rows",
    ) -> None:
        if kind not in BLOCK_LAYOUTS:
            raise ValueError(f"unknown quantized format {kind!r}; known: {', '.join(KINDS)}")
        if layout not in ("rows", "tiles16") or (layout == "tiles16"
                                                 and kind not in PACKED_KINDS):
            raise ValueError(f"{kind} blocks cannot be in layout {layout!r}")
        self.layout = layout
        self.blocks = blocks
        self.row_scales = row_scales
        self.kind = kind
        if len(shape) not in (2, 3):
            raise ValueError(f"a quantized weight is 2-D or 3-D, got shape {tuple(shape)}")
        self.shape = tuple(int(n) for n in shape)
        self.dtype = jnp.dtype(dtype)
        if isinstance(blocks, np.ndarray | jax.Array):
            self._check()

    def _check(self) -> None:
        *lead, inner = self.shape
        want = (*lead, row_bytes(self.kind, inner))
        if tuple(self.blocks.shape) != want:
            raise ValueError(f"{self.kind} blocks of a {self.shape} weight must be {want}, "
                             f"got {tuple(self.blocks.shape)}")
        if (self.kind in ROW_SCALED) != (self.row_scales is not None):
            raise ValueError("int8 weights (and only they) carry row_scales")
        if self.row_scales is not None and tuple(self.row_scales.shape) != tuple(lead):
            raise ValueError(f"row_scales must be {tuple(lead)}, got "
                             f"{tuple(self.row_scales.shape)}")

    # ---- pytree
    def tree_flatten(self) -> tuple[tuple[Any, ...], tuple[str, tuple[int, ...], Any, str]]:
        children = (self.blocks,) if self.row_scales is None else (self.blocks, self.row_scales)
        return children, (self.kind, self.shape, self.dtype, self.layout)

    @classmethod
    def tree_unflatten(cls, aux: tuple[str, tuple[int, ...], Any, str], children: Any) -> Any:
        obj = object.__new__(cls)
        obj.kind, obj.shape, obj.dtype, obj.layout = aux
        obj.blocks = children[0]
        obj.row_scales = children[1] if len(children) > 1 else None
        return obj

    # ---- views
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes the stored arrays hold."""
        total = int(np.prod(self.blocks.shape)) * np.dtype(self.blocks.dtype).itemsize
        if self.row_scales is not None:
            total += int(np.prod(self.row_scales.shape)) * 4
        return total

    def dequantize(self, dtype: Any = None) -> jax.Array:
        """The float weight of :attr:`shape` (traceable; bit-exact with ``gguf``'s reference
        for GGUF formats, in float32 then cast to ``dtype``, default :attr:`dtype`)."""
        rows = self.in_rows()
        return dequantize_rows(rows, rows.blocks, rows.row_scales, dtype)

    def in_rows(self) -> QuantizedWeight:
        """This weight with its blocks in GGUF's row order (traceable; itself if they are)."""
        if self.layout == "rows":
            return self
        return QuantizedWeight(unpack_tiles(self.kind, self.blocks), self.kind, self.shape,
                               self.dtype, self.row_scales)

    def take_rows(self, ids: jax.Array, dtype: Any = None) -> jax.Array:
        """Rows ``ids`` of the float weight (an embedding lookup), dequantizing only them."""
        if self.layout != "rows":
            raise ValueError("rows are taken from weights in GGUF's row order only")
        scales = None if self.row_scales is None else jnp.take(self.row_scales, ids, axis=0)
        return dequantize_rows(self, jnp.take(self.blocks, ids, axis=0), scales, dtype)

    def __repr__(self) -> str:
        packed = "" if self.layout == "rows" else f", layout={self.layout}"
        return (f"QuantizedWeight({self.kind}, shape={self.shape}, "
                f"dtype={self.dtype.name}{packed})")


def dequantize_rows(
    weight: QuantizedWeight, blocks: jax.Array, row_scales: jax.Array | None, dtype: Any
) -> jax.Array:
    """Float values of stored rows ``blocks [..., row_bytes]`` of ``weight``'s format."""
    target = weight.dtype if dtype is None else jnp.dtype(dtype)
    if weight.kind == "int8":
        values = blocks.astype(jnp.float32) * row_scales[..., None].astype(jnp.float32)
    else:
        values = dequantize_blocks(weight.kind, blocks, weight.shape[-1])
    return values.astype(target)


def is_quantized(leaf: Any) -> bool:
    """Whether a params-tree node is a :class:`QuantizedWeight`."""
    return isinstance(leaf, QuantizedWeight)
