"""Q4_0 expert weights packed into tiles of sixteen rows for the CPU kernel.

Owns :func:`pack_q4_0_tiles` (numpy, at load), :func:`unpack_q4_0_tiles` (JAX,
traceable), :func:`can_pack` and :func:`pack_experts`. The layout is Rust's
(``lanes_avx512::pack_q4_0_tiles``, the one owner of its description): per tile of
sixteen weight rows and block of 32 inputs, the rows' sixteen ``f16`` scales, then their
nibbles in the order the kernel's registers hold them. The bytes are GGUF's, reordered;
the blocks' array keeps its shape (:class:`~kvpage.quant.QuantizedWeight`'s
``layout="tiles16"`` says which order it is in).

Why: the CPU kernel reads sixteen weight rows side by side, one per register lane, and
transposed every block of them on the way in. A routed expert sees a few rows at a time
(32 requests: ~4 tokens an expert), so that transposition was a third of its work:
``expert_ffn`` at 32 tokens of ``kvpage bench moe``'s model ran 1.4x faster on packed
weights (2026-11-28, ``benches/RESULTS.md``).

Only what the engine's one MoE host call reads is packed (:func:`pack_experts`): the
routed experts of a model on one CPU device, without a device mesh, batch invariance or
the dense-compute baseline. Every other reader asks the weight for its rows
(``QuantizedWeight.in_rows``), in the step.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvpage.kernels.host._host_ffi import core_library
from kvpage.quant.formats import KINDS
from kvpage.quant.weights import QuantizedWeight

_TILE = 16
_BLOCK = 18  # Q4_0: f16 scale + 16 bytes of nibbles


def can_pack(kind: str, outs: int) -> bool:
    """Whether the core packs ``kind`` matrices of ``outs`` rows on this CPU."""
    return kind == "q4_0" and _core_packs(KINDS.index(kind), outs)


@functools.cache
def _core_packs(code: int, outs: int) -> bool:
    probe = getattr(core_library(), "kvpage_qmatmul_packs", None)
    return probe is not None and bool(probe(code, outs))


def pack_q4_0_tiles(blocks: np.ndarray) -> np.ndarray:
    """Q4_0 blocks ``[..., outs, row_bytes]`` (``outs`` a multiple of 16) in tile order."""
    *lead, outs, row_bytes = blocks.shape
    nb = row_bytes // _BLOCK
    tiles = blocks.reshape(*lead, outs // _TILE, _TILE, nb, _BLOCK)
    scales = np.moveaxis(tiles[..., :2], -3, -2)  # [..., T, nb, 16, 2]
    nibbles = tiles[..., 2:].reshape(*lead, outs // _TILE, _TILE, nb, 4, 4)
    nibbles = np.moveaxis(nibbles, -4, -2)  # [..., T, nb, 4 (register), 16 (row), 4]
    n = len(lead) + 2
    packed = np.concatenate(
        [scales.reshape(*scales.shape[:n], -1), nibbles.reshape(*nibbles.shape[:n], -1)], axis=-1
    )
    return np.ascontiguousarray(packed.reshape(blocks.shape))


def unpack_q4_0_tiles(blocks: jax.Array) -> jax.Array:
    """The inverse of :func:`pack_q4_0_tiles`, traceable."""
    *lead, outs, row_bytes = blocks.shape
    nb = row_bytes // _BLOCK
    n = len(lead) + 2
    packed = blocks.reshape(*lead, outs // _TILE, nb, _TILE * _BLOCK)
    scales = packed[..., : 2 * _TILE].reshape(*packed.shape[:n], _TILE, 2)
    nibbles = packed[..., 2 * _TILE :].reshape(*packed.shape[:n], 4, _TILE, 4)
    scales = jnp.moveaxis(scales, -2, -3)  # [..., T, 16, nb, 2]
    nibbles = jnp.moveaxis(nibbles, -2, -4).reshape(*packed.shape[: n - 1], _TILE, nb, 16)
    rows = jnp.concatenate([scales, nibbles], axis=-1)  # [..., T, 16, nb, 18]
    return rows.reshape(blocks.shape)


def pack_experts(params: dict[str, Any]) -> int:
    """Pack, in place, every routed expert matrix of ``params`` that :func:`can_pack`;
    returns how many were packed."""
    packed = 0
    for layer in params.get("layers", []):
        experts = layer.get("mlp", {}).get("experts") if isinstance(layer, dict) else None
        if not isinstance(experts, dict):
            continue
        for name in ("gate_proj", "up_proj", "down_proj"):
            node = experts.get(name)
            w = None if node is None else node.get("weight")
            if (
                not isinstance(w, QuantizedWeight)
                or w.layout != "rows"
                or w.ndim != 3
                or not can_pack(w.kind, w.shape[1])
            ):
                continue
            node["weight"] = QuantizedWeight(
                jnp.asarray(pack_q4_0_tiles(np.asarray(w.blocks))),
                w.kind,
                w.shape,
                w.dtype,
                w.row_scales,
                layout="tiles16",
            )
            packed += 1
    return packed
