"""Q4_0 and Q4_1 weights packed into tiles of sixteen rows for the CPU kernel.

Owns :func:`pack_tiles` (numpy, at load), :func:`unpack_tiles` (JAX, traceable) and
:func:`can_pack`. The layout is Rust's
(``lanes_avx512::pack_tiles``, the one owner of its description): per tile of sixteen
weight rows and block of 32 inputs, each ``f16`` field of the block (``d``; Q4_1: ``d``
then ``m``) of the sixteen rows, then their nibbles in the order the kernel's registers
hold them. The bytes are GGUF's, reordered; the blocks' array keeps its shape
(:class:`~kvpage.quant.QuantizedWeight`'s ``layout="tiles16"`` says which order it is in).

Why: the CPU kernel reads sixteen weight rows side by side, one per register lane, and
transposed every block of them on the way in; a tile packed once at load is one stream
and needs none (``expert_ffn`` of ``kvpage bench moe``'s model 1.15x at one token, 1.14x
at 32; 2026-11-28, ``benches/RESULTS.md``).

Which weights are packed: :mod:`kvpage.quant.packing`. Every reader other than the host
kernels asks a weight for its rows (``QuantizedWeight.in_rows``), in the step.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvpage.kernels.host._host_ffi import core_library
from kvpage.quant.formats import KINDS

TILE = 16
PACKED_KINDS = {"q4_0": 18, "q4_1": 20}
"""The formats packed into tiles, and their block bytes (``f16`` fields + 16 of nibbles)."""
# Last five axes of a tile (tile, row, block, group, byte) -> (tile, block, group, row, byte).
_PACK = (0, 2, 3, 1, 4)
_UNPACK = (0, 3, 1, 2, 4)


def can_pack(kind: str, outs: int) -> bool:
    """Whether the core packs ``kind`` matrices of ``outs`` rows on this CPU."""
    return kind in PACKED_KINDS and _core_packs(KINDS.index(kind), outs)


@functools.cache
def _core_packs(code: int, outs: int) -> bool:
    probe = getattr(core_library(), "kvpage_qmatmul_packs", None)
    return probe is not None and bool(probe(code, outs))


def _split(kind: str, blocks: Any) -> tuple[list[int], int, int, int]:
    *lead, outs, row_bytes = blocks.shape
    bb = PACKED_KINDS[kind]
    return lead, outs // TILE, row_bytes // bb, bb - 16


def pack_tiles(kind: str, blocks: np.ndarray) -> np.ndarray:
    """``kind`` blocks ``[..., outs, row_bytes]`` (``outs`` a multiple of 16) in tile order."""
    lead, tiles, nb, head = _split(kind, blocks)
    t = blocks.reshape(*lead, tiles, TILE, nb, PACKED_KINDS[kind])
    n = len(lead)
    perm = (*range(n), *(n + a for a in _PACK))
    fields = t[..., :head].reshape(*lead, tiles, TILE, nb, head // 2, 2).transpose(perm)
    nibbles = t[..., head:].reshape(*lead, tiles, TILE, nb, 4, 4).transpose(perm)
    packed = np.concatenate([fields.reshape(*lead, tiles, nb, -1),
                             nibbles.reshape(*lead, tiles, nb, -1)], axis=-1)
    return np.ascontiguousarray(packed.reshape(blocks.shape))


def unpack_tiles(kind: str, blocks: jax.Array) -> jax.Array:
    """The inverse of :func:`pack_tiles`, traceable."""
    lead, tiles, nb, head = _split(kind, blocks)
    t = blocks.reshape(*lead, tiles, nb, TILE * PACKED_KINDS[kind])
    n = len(lead)
    perm = (*range(n), *(n + a for a in _UNPACK))
    fields = t[..., : TILE * head].reshape(*lead, tiles, nb, head // 2, TILE, 2)
    nibbles = t[..., TILE * head :].reshape(*lead, tiles, nb, 4, TILE, 4)
    rows = jnp.concatenate([
        jnp.transpose(fields, perm).reshape(*lead, tiles, TILE, nb, head),
        jnp.transpose(nibbles, perm).reshape(*lead, tiles, TILE, nb, 16),
    ], axis=-1)
    return rows.reshape(blocks.shape)
