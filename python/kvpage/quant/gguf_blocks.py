"""GGUF's block formats dequantized in JAX, bit-exact with the ``gguf`` package.

Owns :func:`dequantize_blocks`: stored rows ``uint8 [..., row_bytes]`` of Q8_0, Q4_0,
Q4_1, Q5_0, Q5_1, Q4_K or Q6_K to float32 ``[..., in]``, in the same float32 operations, in the
same order, as ``gguf.quants`` (llama.cpp's reference), so an embedding row or a
weight dequantized inside a step equals what the load-time path produced. Layouts:
``rust/kernels/quant/formats.rs`` (block sizes from its table, :mod:`kvpage.quant.formats`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from kvpage.quant.formats import BLOCK_LAYOUTS


def _f16(raw: jax.Array) -> jax.Array:
    """float32 of little-endian halves ``uint8 [..., 2]`` -> ``[...]``."""
    return lax.bitcast_convert_type(raw, jnp.float16).astype(jnp.float32)


def _nibbles(qs: jax.Array, group: int) -> jax.Array:
    """``uint8 [..., n * group]`` -> ``[..., n, 2, group]``: per group of bytes, the low
    nibbles then the high ones."""
    grouped = qs.reshape(*qs.shape[:-1], -1, 1, group)
    shifts = jnp.array([0, 4], jnp.uint8).reshape(2, 1)
    return (grouped >> shifts) & jnp.uint8(15)


def _q4k_scale_min(scales: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The 6-bit scales and mins of Q4_K's 8 sub-blocks from their 12 packed bytes."""
    d, m, m_d = scales[..., 0:4], scales[..., 4:8], scales[..., 8:12]
    sc = jnp.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = jnp.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc, mn


def dequantize_blocks(kind: str, rows: jax.Array, inner: int) -> jax.Array:
    """float32 ``[..., inner]`` of stored rows ``uint8 [..., row_bytes]`` of ``kind``."""
    elems, size = BLOCK_LAYOUTS[kind]
    lead = rows.shape[:-1]
    b = rows.reshape(*lead, inner // elems, size)
    if kind == "q8_0":
        d = _f16(b[..., 0:2])[..., None]
        q = lax.bitcast_convert_type(b[..., 2:], jnp.int8).astype(jnp.float32)
        values = q * d
    elif kind in ("q4_0", "q4_1"):
        d = _f16(b[..., 0:2])[..., None]
        start = 2 if kind == "q4_0" else 4
        q = _nibbles(b[..., start:], 16).reshape(*b.shape[:-1], 32)
        if kind == "q4_0":
            values = d * (q.astype(jnp.int8) - jnp.int8(8)).astype(jnp.float32)
        else:
            values = (d * q.astype(jnp.float32)) + _f16(b[..., 2:4])[..., None]
    elif kind in ("q5_0", "q5_1"):
        d = _f16(b[..., 0:2])[..., None]
        start = 2 if kind == "q5_0" else 4
        qh = lax.bitcast_convert_type(b[..., start : start + 4], jnp.uint32)
        bits = (qh[..., None] >> jnp.arange(32, dtype=jnp.uint32)) & jnp.uint32(1)
        low = _nibbles(b[..., start + 4 :], 16).reshape(*b.shape[:-1], 32)
        q = low | (bits.astype(jnp.uint8) << jnp.uint8(4))
        if kind == "q5_0":
            values = d * (q.astype(jnp.int8) - jnp.int8(16)).astype(jnp.float32)
        else:
            values = (d * q.astype(jnp.float32)) + _f16(b[..., 2:4])[..., None]
    elif kind == "q4_k":
        d = _f16(b[..., 0:2])[..., None]
        dmin = _f16(b[..., 2:4])[..., None]
        sc, mn = _q4k_scale_min(b[..., 4:16])
        scale = (d * sc.astype(jnp.float32))[..., None]
        offset = (dmin * mn.astype(jnp.float32))[..., None]
        q = _nibbles(b[..., 16:], 32).reshape(*b.shape[:-1], 8, 32).astype(jnp.float32)
        values = (scale * q - offset).reshape(*b.shape[:-1], 256)
    elif kind == "q6_k":
        ql, qh = b[..., 0:128], b[..., 128:192]
        scales = lax.bitcast_convert_type(b[..., 192:208], jnp.int8).astype(jnp.float32)
        d = _f16(b[..., 208:210])[..., None]
        scale = (d * scales)[..., None]  # [..., 16, 1]
        low = _nibbles(ql, 64).reshape(*b.shape[:-1], 8, 32)
        shifts = jnp.array([0, 2, 4, 6], jnp.uint8).reshape(4, 1)
        high = ((qh.reshape(*b.shape[:-1], 2, 1, 32) >> shifts) & jnp.uint8(3))
        high = high.reshape(*b.shape[:-1], 8, 32)
        q = (low | (high << jnp.uint8(4))).astype(jnp.int8) - jnp.int8(32)
        q = q.reshape(*b.shape[:-1], 16, 16).astype(jnp.float32)
        values = (scale * q).reshape(*b.shape[:-1], 256)
    else:
        raise ValueError(f"{kind!r} is not a GGUF block format")
    return values.reshape(*lead, inner)
