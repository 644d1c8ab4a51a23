"""Ragged paged attention: one Pallas kernel for mixed prefill + decode steps.

Owns :func:`ragged_paged_attention`, the general kernel behind the contract in
``reference.py``: the queries of many sequences are concatenated along the
token axis (``cu_q_lens``); each row attends causally to its own paged KV
through its block table. Prefill chunks (queries starting mid-sequence,
``kv_len > q_len``), decodes (``q_len == 1``) and padded rows share one call.

Work decomposition
------------------
* A *work item* is one query block: up to ``block_q`` consecutive query
  tokens of one row. The wrapper builds the item list with a few tiny jnp ops
  (``item_row``, ``item_qblk``; rows >= ``num_seqs`` get no items, unused
  tail items have row -1 and do nothing). There are at most
  ``(T + min(S, T) * (block_q - 1)) // block_q`` items, a static bound.
* Grid: ``(num_items, num_kv_heads)``. Program ``(i, h)`` computes item ``i``
  for KV head ``h`` and *all* ``G = Hq // Hkv`` query heads of that group at
  once: its query tile is ``[block_q * G_pad, D]`` (token-major, head-minor),
  so every K/V page is loaded once per KV head, never once per query head.
* Inner loop: ``lax.fori_loop`` over the item's KV compute blocks of
  ``pages_per_compute_block`` pages, only up to the last position the item's
  queries can see (``min(kv_len, last query position + 1)``), so pages at or
  past ``kv_len`` (and block-table entries past ``ceil(kv_len / B)``) are
  never touched. Pages are gathered through the block table with masked
  loads (masked lanes read nothing and yield 0: this is also the value guard
  that keeps NaN/inf garbage out of ``p @ V``); scores outside the causal /
  length window are set to -inf before the online softmax.
* Online softmax (flash attention) in float32, in base 2 (scores are scaled
  by ``sm_scale * log2(e)`` and exponentiated with ``exp2``).
* Tokens that no item covers (padding past ``cu_q_lens[num_seqs]``) keep the
  zeros of the aliased zero-initialised output buffer.
* Options (contract: ``reference.py``). ``sliding_window``: an item's KV loop
  starts at the page holding the first position its first query's window sees,
  so pages wholly outside the window (and their block-table entries) are never
  loaded; the per-query window is part of the ``visible`` mask.
  ``logit_soft_cap``: applied to the score tile before the mask.
  ``sinks``: an extra ``[Hq]`` operand (only when given), folded into each
  query head's denominator after the loop. ``None`` traces none of this.

Metadata (lengths, ``cu_q_lens``, block tables, the item list) is passed as
plain whole-array inputs and read with scalar loads: the Triton backend has
no scalar prefetch, and global-memory scalar loads of a few ints are cheap.

Assumptions
-----------
* GPU path goes through Pallas' Triton lowering, where every tensor must have
  a power-of-two size: ``block_size`` (B), ``head_dim`` (D), ``block_q`` and
  ``pages_per_compute_block`` must be powers of two; the query group is padded
  to a power of two internally. ``tl.dot`` needs every dim >= 16: the
  wrapper rejects ``block_q * G_pad < 16`` or ``B * pages_per_compute_block
  < 16`` (in interpret mode too, so CPU tests only run GPU-valid tilings).
  Typical: B in {8, 16, 32}, D in {64, 128}.
* ``kv_len`` is clamped to ``max_blocks * B`` like the reference.
* K/V inside ``kv_len`` are finite (they were written this step or before);
  only slots at or past ``kv_len`` may hold garbage. (The reference also
  zeroes non-finite V *inside* ``kv_len``; the kernel does not spend ALU on
  that, so a NaN written into a live slot shows up instead of vanishing.)
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kvpage.kernels.pallas._compat import (
    LOG2E,
    SQUEEZED,
    check_dot_tile,
    is_power_of_2,
    masked_load,
    masked_store,
    next_power_of_2,
    triton_compiler_params,
)
from kvpage.kernels.pallas._tiles import (
    Carry,
    add_sink,
    init_carry,
    load_kv_tiles,
    online_softmax_step,
)
from kvpage.kernels.xla.reference import check_attention_options


def _ragged_kernel(
    *refs: Any,
    scale: float,
    group: int,
    group_pad: int,
    block_q: int,
    pages_per_block: int,
    block_size: int,
    max_len: int,
    sliding_window: int | None,
    soft_cap: float | None,
    has_sinks: bool,
) -> None:
    # item_row [num_items] int32 (-1: unused item), item_qblk [num_items] int32 (query
    # block inside the row), cu_q_lens [S + 1], kv_lens [S], block_tables [S, max_blocks],
    # q [T, Hkv, G, D], sinks [Hq] float32 (only with has_sinks), k_pages and v_pages
    # [P, B, D] (this program's KV head), zeros [T, Hkv, G, D] (aliased with o_ref; never
    # read), o_ref [T, Hkv, G, D].
    item_row_ref, item_qblk_ref, cu_q_lens_ref, kv_lens_ref, block_tables_ref, q_ref = refs[:6]
    sinks_ref = refs[6] if has_sinks else None
    k_pages_ref, v_pages_ref, _zeros_ref, o_ref = refs[6 + has_sinks :]
    item = pl.program_id(0)
    head = pl.program_id(1)
    head_dim = q_ref.shape[-1]
    bq, gp = block_q, group_pad
    rows_m = bq * gp
    block_k = pages_per_block * block_size

    raw_row = item_row_ref[item]
    active = raw_row >= 0
    row = jnp.maximum(raw_row, 0)
    qblk = item_qblk_ref[item]
    q_begin = cu_q_lens_ref[row]
    q_len = cu_q_lens_ref[row + 1] - q_begin
    kv_len = kv_lens_ref[row]
    first_local = qblk * bq  # index of the block's first query inside the row
    tok0 = q_begin + first_local

    # KV extent this block can see: up to its last query's position (inclusive).
    last_local = jnp.minimum(q_len, first_local + bq)
    n_kv = jnp.clip(kv_len - q_len + last_local, 0, max_len)
    n_kv = jnp.where(active, n_kv, 0)

    # Per-tile-row metadata; tile row r is token r // gp, query head r % gp.
    r = jnp.arange(rows_m, dtype=jnp.int32)
    local_r = first_local + r // gp
    row_ok = active & (local_r < q_len) & (r % gp < group)
    q_pos = kv_len - q_len + local_r  # [M]

    tok_ok = active & (first_local + jnp.arange(bq, dtype=jnp.int32) < q_len)  # [bq]
    head_ok = jnp.arange(gp, dtype=jnp.int32) < group  # [gp]
    mask3 = jnp.broadcast_to((tok_ok[:, None] & head_ok[None, :])[:, :, None], (bq, gp, head_dim))
    q_idx = (pl.ds(tok0, bq), head, pl.ds(0, gp), slice(None))
    q = masked_load(q_ref, q_idx, mask=mask3, other=0).reshape(rows_m, head_dim)

    # First KV slot the loop visits: 0, or the first slot of the page holding the
    # lowest position the block's first query's window sees.
    if sliding_window is not None:
        lowest = jnp.maximum(kv_len - q_len + first_local - (sliding_window - 1), 0)
        kv_begin = (lowest // block_size) * block_size

    def body(j: jax.Array, carry: Carry) -> Carry:
        first_slot = j * block_k if sliding_window is None else kv_begin + j * block_k
        k, v = load_kv_tiles(
            k_pages_ref,
            v_pages_ref,
            block_tables_ref,
            row,
            first_slot,
            n_kv,
            block_k=block_k,
            block_size=block_size,
        )
        kv_pos = first_slot + jnp.arange(block_k, dtype=jnp.int32)
        visible = row_ok[:, None] & (kv_pos[None, :] <= q_pos[:, None]) & (kv_pos[None, :] < n_kv)
        if sliding_window is not None:
            visible = visible & (kv_pos[None, :] > q_pos[:, None] - sliding_window)
        return online_softmax_step(q, k, v, visible, carry, scale=scale, soft_cap=soft_cap)

    if sliding_window is None:
        n_blocks = (n_kv + block_k - 1) // block_k
    else:
        n_blocks = jnp.maximum(n_kv - kv_begin + block_k - 1, 0) // block_k
    carry = lax.fori_loop(0, n_blocks, body, init_carry(rows_m, head_dim))
    if has_sinks:
        head_of_r = r % gp
        sink = masked_load(sinks_ref, (head * group + head_of_r,), mask=head_of_r < group, other=0)
        carry = add_sink(carry, sink * LOG2E)
    acc, _, l_sum = carry
    out = acc / jnp.where(l_sum == 0.0, 1.0, l_sum)[:, None]
    out = out.reshape(bq, gp, head_dim).astype(o_ref.dtype)
    masked_store(o_ref, q_idx, out, mask=mask3)


def build_work_items(
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    block_q: int,
    num_items: int,
    skip_rows: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Map each grid item to ``(row, query block in row)``; unused items get row -1.

    Rows where ``skip_rows`` ([S] bool) holds get no items (their tokens stay 0).
    """
    num_rows = cu_q_lens.shape[0] - 1
    q_lens = jnp.maximum(cu_q_lens[1:] - cu_q_lens[:-1], 0)
    live = jnp.arange(num_rows, dtype=jnp.int32) < num_seqs[0]
    if skip_rows is not None:
        live = live & ~skip_rows
    blocks = jnp.where(live, (q_lens + block_q - 1) // block_q, 0).astype(jnp.int32)
    ends = jnp.cumsum(blocks).astype(jnp.int32)
    starts = ends - blocks
    items = jnp.arange(num_items, dtype=jnp.int32)
    row = jnp.searchsorted(ends, items, side="right").astype(jnp.int32)
    row_c = jnp.minimum(row, num_rows - 1)
    valid = items < ends[-1]
    item_row = jnp.where(valid, row_c, -1).astype(jnp.int32)
    item_qblk = jnp.where(valid, items - starts[row_c], 0).astype(jnp.int32)
    return item_row, item_qblk


def max_work_items(num_tokens: int, num_rows: int, block_q: int) -> int:
    """Static upper bound of ``sum_s ceil(q_len_s / block_q)`` given ``sum_s q_len_s <= T``."""
    busy_rows = min(num_rows, num_tokens)
    return max(1, (num_tokens + busy_rows * (block_q - 1)) // block_q)


def default_block_q(group_pad: int, num_tokens: int) -> int:
    """Query tokens per block: a 64-row tile, at least 16 rows (tl.dot minimum)."""
    target = max(1, 64 // group_pad)
    floor = max(1, 16 // group_pad)
    return max(floor, min(target, next_power_of_2(num_tokens)))


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "interpret",
        "block_q",
        "pages_per_compute_block",
        "num_warps",
        "num_stages",
        "sliding_window",
        "logit_soft_cap",
    ),
)
def ragged_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    skip_rows: jax.Array | None = None,
    *,
    sm_scale: float,
    interpret: bool = False,
    block_q: int | None = None,
    pages_per_compute_block: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    sliding_window: int | None = None,
    logit_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Ragged paged attention with the exact semantics of the reference.

    Args:
      q: ``[T, Hq, D]`` queries of all rows, concatenated.
      k_pages, v_pages: ``[Hkv, P, B, D]`` KV pools of one layer.
      kv_lens: ``[S]`` int32 KV length of each row after this step.
      block_tables: ``[S, max_blocks]`` int32 physical block of each logical block.
      cu_q_lens: ``[S + 1]`` int32 query offsets of the rows.
      num_seqs: ``[1]`` int32; rows at or past it are padding.
      skip_rows: optional ``[S]`` bool; rows where it holds are not computed
        (their tokens come back 0), for callers that send them elsewhere.
      sm_scale: softmax scale (static).
      interpret: run the kernel with Pallas' interpreter (CPU testing).
      block_q: query tokens per work item (power of two); default keeps the
        ``block_q * G_pad`` tile between 16 and 64 rows.
      pages_per_compute_block: pages per inner-loop step (power of two);
        default makes a 64-token KV block (at least one page).
      num_warps, num_stages: Triton launch parameters (ignored by the interpreter).
      sliding_window, logit_soft_cap (static), sinks (``[Hq]`` float32): the
        contract's options (``reference.py``).

    Returns:
      ``[T, Hq, D]`` in ``q.dtype``; padded tokens are zeros.
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, block_size, head_dim_k = k_pages.shape
    num_rows, max_blocks = block_tables.shape
    if v_pages.shape != k_pages.shape:
        raise ValueError(f"k_pages {k_pages.shape} and v_pages {v_pages.shape} differ")
    if head_dim_k != head_dim:
        raise ValueError(f"head_dim of q ({head_dim}) and pages ({head_dim_k}) differ")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"{num_q_heads=} is not a multiple of {num_kv_heads=}")
    if kv_lens.shape != (num_rows,) or cu_q_lens.shape != (num_rows + 1,):
        raise ValueError("kv_lens must be [S] and cu_q_lens [S + 1] for block_tables [S, _]")
    if not (is_power_of_2(block_size) and is_power_of_2(head_dim)):
        raise ValueError(f"{block_size=} and {head_dim=} must be powers of two")
    check_attention_options(sliding_window, logit_soft_cap, sinks, num_q_heads)
    group = num_q_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    if block_q is None:
        block_q = default_block_q(group_pad, num_tokens)
    if pages_per_compute_block is None:
        pages_per_compute_block = max(1, 64 // block_size)
    if not (is_power_of_2(block_q) and is_power_of_2(pages_per_compute_block)):
        raise ValueError(f"{block_q=} and {pages_per_compute_block=} must be powers of two")
    check_dot_tile(rows=block_q * group_pad, block_k=pages_per_compute_block * block_size)

    num_items = max_work_items(num_tokens, num_rows, block_q)
    item_row, item_qblk = build_work_items(
        cu_q_lens, num_seqs, block_q=block_q, num_items=num_items, skip_rows=skip_rows
    )
    q4 = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    zeros = jnp.zeros_like(q4)

    kernel = functools.partial(
        _ragged_kernel,
        scale=float(sm_scale) * LOG2E,
        group=group,
        group_pad=group_pad,
        block_q=block_q,
        pages_per_block=pages_per_compute_block,
        block_size=block_size,
        max_len=max_blocks * block_size,
        sliding_window=sliding_window,
        soft_cap=None if logit_soft_cap is None else float(logit_soft_cap),
        has_sinks=sinks is not None,
    )

    def whole(x: jax.Array) -> pl.BlockSpec:
        origin = (0,) * x.ndim
        return pl.BlockSpec(x.shape, lambda i, h: origin)

    pool_spec = pl.BlockSpec((SQUEEZED, num_pages, block_size, head_dim), lambda i, h: (h, 0, 0, 0))
    operands = (
        item_row,
        item_qblk,
        cu_q_lens.astype(jnp.int32),
        kv_lens.astype(jnp.int32),
        block_tables.astype(jnp.int32),
        q4,
        *(() if sinks is None else (sinks.astype(jnp.float32),)),
        k_pages,
        v_pages,
        zeros,
    )
    metadata = operands[:-3]
    in_specs = [whole(x) for x in metadata] + [pool_spec, pool_spec, whole(zeros)]
    out = pl.pallas_call(
        kernel,
        grid=(num_items, num_kv_heads),
        in_specs=in_specs,
        out_specs=whole(q4),
        out_shape=jax.ShapeDtypeStruct(q4.shape, q.dtype),
        input_output_aliases={len(operands) - 1: 0},
        interpret=interpret,
        compiler_params=triton_compiler_params(num_warps, num_stages),
        name=f"ragged_paged_attention_bq{block_q}_pp{pages_per_compute_block}",
    )(*operands)
    return out.reshape(num_tokens, num_q_heads, head_dim)
