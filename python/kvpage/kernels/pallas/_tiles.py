"""In-kernel building blocks shared by the paged-attention kernels.

Owns the two pieces both kernels run inside their page loop:

* :func:`load_kv_tiles` - gather a block of logical KV slots of one row
  through its block table into dense ``[block_k, D]`` K and V tiles, with
  masked loads: block-table entries past the row's last needed page and KV
  slots at or past the visible length are never read and come back as 0
  (the value guard that keeps NaN/inf garbage out of ``p @ V``).
* :func:`online_softmax_step` - one flash-attention update in float32, base 2
  (with the contract's optional logit soft-cap);
* :func:`add_sink` - an attention sink's logit folded into a finished denominator.

These are traced inside ``pallas_call`` kernels (Triton lowering on GPU,
the Pallas interpreter on CPU). Triton needs power-of-two tile sizes and
every ``dot`` dim >= 16; callers guarantee that.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from kvpage.kernels.pallas._compat import LOG2E, masked_load

_DOT_QK = (((1,), (1,)), ((), ()))  # [M, D] x [N, D] -> [M, N]
_DOT_PV = (((1,), (0,)), ((), ()))  # [M, N] x [N, D] -> [M, D]

# HIGHEST makes float32 dots exact (IEEE) in the Triton lowering instead of
# TF32; bf16/fp16 inputs are unaffected (native tensor-core dots either way).
_PRECISION = lax.Precision.HIGHEST

Carry = tuple[jax.Array, jax.Array, jax.Array]


def load_kv_tiles(
    k_pages_ref: Any,
    v_pages_ref: Any,
    block_tables_ref: Any,
    row: jax.Array,
    first_slot: jax.Array,
    n_kv: jax.Array,
    *,
    block_k: int,
    block_size: int,
) -> tuple[jax.Array, jax.Array]:
    """K and V ``[block_k, D]`` tiles of logical slots ``first_slot ..+block_k`` of ``row``.

    ``k_pages_ref``/``v_pages_ref`` are one KV head's pools ``[P, B, D]``.
    Tile row ``i`` is logical slot ``first_slot + i``, found through the block
    table (``first_slot`` is a multiple of ``block_size``). Slots at or past
    ``n_kv`` are masked everywhere - their block-table entry and their K/V are
    never read - and come back as 0.

    The block's page ids are loaded once (one masked load of ``block_k / B``
    entries, only pages holding a slot below ``n_kv``) and broadcast to their
    ``B`` slots, so per-slot address computation does not wait on a per-slot
    table lookup. Offsets are then built directly in 2-D, so loads stay
    contiguous along ``D``.
    """
    head_dim = k_pages_ref.shape[-1]
    pages_per_block = block_k // block_size
    first_page = first_slot // block_size
    page = first_page + jnp.arange(pages_per_block, dtype=jnp.int32)  # [PP]
    page_ids = masked_load(
        block_tables_ref, (row, page), mask=page * block_size < n_kv, other=0
    )  # [PP]
    phys = jnp.broadcast_to(page_ids[:, None], (pages_per_block, block_size)).reshape(block_k)
    slot = first_slot + jnp.arange(block_k, dtype=jnp.int32)  # [BK]
    ok = slot < n_kv
    shape = (block_k, head_dim)
    idx = (
        jnp.broadcast_to(phys[:, None], shape),
        jnp.broadcast_to((slot % block_size)[:, None], shape),
        jnp.broadcast_to(jnp.arange(head_dim, dtype=jnp.int32)[None, :], shape),
    )
    mask = jnp.broadcast_to(ok[:, None], shape)
    k = masked_load(k_pages_ref, idx, mask=mask, other=0)
    v = masked_load(v_pages_ref, idx, mask=mask, other=0)
    return k, v


def online_softmax_step(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    visible: jax.Array,
    carry: Carry,
    *,
    scale: float,
    soft_cap: float | None = None,
) -> Carry:
    """One flash-attention update; scores live in base 2 (``scale`` includes log2 e).

    ``q`` [M, D], ``k``/``v`` [N, D], ``visible`` [M, N]; ``carry`` is
    ``(acc [M, D], m [M], l [M])`` in float32 with ``m`` starting at -inf.
    Rows that have seen nothing keep ``acc = l = 0`` and ``m = -inf``.
    ``soft_cap`` (natural-log units, like the contract's): the scaled score ``x``
    becomes ``soft_cap * tanh(x / soft_cap)`` before the mask.
    """
    acc, m_prev, l_prev = carry
    s = lax.dot_general(q, k, _DOT_QK, precision=_PRECISION, preferred_element_type=jnp.float32)
    if soft_cap is None:
        s = s * scale
    else:  # scale / LOG2E is sm_scale; the capped score goes back to base 2
        s = (soft_cap * LOG2E) * jnp.tanh(s * (scale / (LOG2E * soft_cap)))
    s = jnp.where(visible, s, -jnp.inf)
    m_next = jnp.maximum(m_prev, jnp.max(s, axis=1))
    # Anchor fully masked rows at 0 so exp2(-inf - anchor) is 0, never NaN.
    anchor = jnp.where(m_next == -jnp.inf, 0.0, m_next)
    alpha = jnp.exp2(m_prev - anchor)
    p = jnp.exp2(s - anchor[:, None])
    l_next = alpha * l_prev + jnp.sum(p, axis=1)
    pv = lax.dot_general(
        p.astype(v.dtype), v, _DOT_PV, precision=_PRECISION, preferred_element_type=jnp.float32
    )
    return alpha[:, None] * acc + pv, m_next, l_next


def add_sink(carry: Carry, sink: jax.Array) -> Carry:
    """Fold one sink logit per row (``[M]``, base 2) into a finished carry's denominator.

    ``acc / l`` of the result is ``sum_j 2^s_j v_j / (sum_j 2^s_j + 2^sink)``; rows that
    saw nothing keep ``acc = 0``.
    """
    acc, m, l_sum = carry
    m_new = jnp.maximum(m, sink)
    alpha = jnp.exp2(m - m_new)  # 0 for rows that saw nothing (m = -inf)
    return acc * alpha[:, None], m_new, l_sum * alpha + jnp.exp2(sink - m_new)


def init_carry(rows: int, head_dim: int) -> Carry:
    return (
        jnp.zeros((rows, head_dim), jnp.float32),
        jnp.full((rows,), -jnp.inf, jnp.float32),
        jnp.zeros((rows,), jnp.float32),
    )
