"""Decode-specialised paged attention: split-K over long contexts + LSE combine.

Owns :func:`paged_decode_attention`, the same contract as ``reference.py``
restricted to pure-decode steps: every row has ``q_len`` 0 or 1 (padded
rows ``q_len == 0``, ``kv_len == 0``; a live row with ``q_len == 0`` simply
gets no output). With one query token per row the
ragged kernel's parallelism is only ``rows x kv_heads`` programs, which
underfills a GPU at small batch / long context; this kernel also splits each
row's pages across ``num_splits`` programs and merges their partial softmax
results afterwards.

Work decomposition
------------------
* Grid: ``(num_rows, num_kv_heads, num_splits)``. Program ``(s, h, k)`` takes
  row ``s``'s single query token (at ``cu_q_lens[s]``) for *all* ``G`` query
  heads of KV head ``h`` (a ``[block_h, D]`` tile, ``block_h >= 16`` padded
  for ``tl.dot``), so each K/V page is loaded once per KV head.
* Splits are planned per row from its live length inside the kernel: the
  grid's ``num_splits`` is an upper bound, a row of ``n`` live compute blocks
  uses ``clip(ceil(n / min_blocks_per_split), 1, num_splits)`` splits and split
  ``k`` covers an equal share of them; splits past that do no work. Nothing at or past ``kv_len``
  is loaded (masked loads; masked lanes read nothing and yield 0).
* Inner loop: ``lax.fori_loop`` over compute blocks of
  ``pages_per_compute_block`` pages, online softmax in float32 (base 2).
* Each program writes its normalised partial output ``[G, D]`` and its
  log-sum-exp ``[G]`` (base 2, -inf when the split saw nothing). A small jnp
  epilogue merges the splits (``out = sum_k w_k o_k / sum_k w_k`` with
  ``w_k = 2^(lse_k - max lse)``) and scatters row results to their token
  slots; tokens of padded rows / padding tokens are zeros.

Options (contract: ``reference.py``). ``sliding_window``: the split plan covers
the row's pages from the one holding its window's first position (``kv_len -
window``), so pages wholly outside the window are never loaded; slots of that
first page below the window are masked. ``logit_soft_cap``: applied to the
score tile before the mask. ``sinks``: folded into the denominator once, by the
jnp epilogue that merges the splits (``combine_splits``), never per split.
``None`` traces none of this.

Assumptions
-----------
* Same Triton constraints as the ragged kernel: power-of-two ``block_size``,
  ``head_dim``, ``pages_per_compute_block``; ``block_h`` a power of two >= 16
  and >= the query group; ``B * pages_per_compute_block >= 16``.
* Rows with ``q_len > 1`` are outside this kernel's contract (use the ragged
  kernel); such a row is computed for its *first* query token only, as if
  that token were at position ``kv_len - 1``.
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
    init_carry,
    load_kv_tiles,
    online_softmax_step,
)
from kvpage.kernels.xla.reference import check_attention_options

# Programs a call should launch to fill an H100/H200 (132 SMs, ~2 waves);
# the auto split count aims for this.
TARGET_PROGRAMS = 264
MAX_AUTO_SPLITS = 16
# A split of a row gets at least this many compute blocks (2 x 128 tokens by
# default), so short rows are not cut into slivers whose LSE merge costs more
# than the work they parallelise.
MIN_BLOCKS_PER_SPLIT = 2


def _decode_kernel(
    num_seqs_ref: Any,  # [1] int32
    cu_q_lens_ref: Any,  # [S + 1] int32
    kv_lens_ref: Any,  # [S] int32
    block_tables_ref: Any,  # [S, max_blocks] int32
    q_ref: Any,  # [T, Hkv, G, D]
    k_pages_ref: Any,  # [P, B, D] (this program's KV head)
    v_pages_ref: Any,  # [P, B, D]
    o_ref: Any,  # [K, S, Hkv, G, D] float32, normalised partial outputs
    lse_ref: Any,  # [K, S, Hkv, G] float32, base-2 log-sum-exp of each partial
    *,
    scale: float,
    group: int,
    block_h: int,
    num_splits: int,
    min_blocks_per_split: int,
    pages_per_block: int,
    block_size: int,
    max_len: int,
    sliding_window: int | None,
    soft_cap: float | None,
) -> None:
    row = pl.program_id(0)
    head = pl.program_id(1)
    split = pl.program_id(2)
    head_dim = q_ref.shape[-1]
    block_k = pages_per_block * block_size

    tok = cu_q_lens_ref[row]
    active = (row < num_seqs_ref[0]) & (cu_q_lens_ref[row + 1] > tok)
    n_kv = jnp.where(active, jnp.clip(kv_lens_ref[row], 0, max_len), 0)
    if sliding_window is not None:  # the query (position n_kv - 1) sees slots >= lowest
        lowest = jnp.maximum(n_kv - sliding_window, 0)
        kv_begin = (lowest // block_size) * block_size
    # Split plan from the row's live length: the grid's ``num_splits`` is only an
    # upper bound; a row uses as many splits as give each >= ``min_blocks_per_split``
    # compute blocks, and this split takes its equal share (none if past the end).
    if sliding_window is None:
        blocks_total = (n_kv + block_k - 1) // block_k
    else:
        blocks_total = (n_kv - kv_begin + block_k - 1) // block_k
    row_splits = jnp.clip(
        (blocks_total + min_blocks_per_split - 1) // min_blocks_per_split, 1, num_splits
    )
    blocks_per_split = (blocks_total + row_splits - 1) // row_splits
    first_block = split * blocks_per_split
    n_blocks = jnp.clip(blocks_total - first_block, 0, blocks_per_split)

    h_ok = jnp.arange(block_h, dtype=jnp.int32) < group  # [block_h]
    q_mask = jnp.broadcast_to((h_ok & active)[:, None], (block_h, head_dim))
    q = masked_load(q_ref, (tok, head, pl.ds(0, block_h), slice(None)), mask=q_mask, other=0)

    def body(j: jax.Array, carry: Carry) -> Carry:
        first_slot = (first_block + j) * block_k
        if sliding_window is not None:
            first_slot = kv_begin + first_slot
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
        live = kv_pos < n_kv
        if sliding_window is not None:
            live = live & (kv_pos >= lowest)
        visible = h_ok[:, None] & live[None, :]
        return online_softmax_step(q, k, v, visible, carry, scale=scale, soft_cap=soft_cap)

    acc, m, l_sum = lax.fori_loop(0, n_blocks, body, init_carry(block_h, head_dim))
    seen = l_sum > 0.0
    out = acc / jnp.where(seen, l_sum, 1.0)[:, None]
    lse = jnp.where(seen, m + jnp.log2(jnp.where(seen, l_sum, 1.0)), -jnp.inf)
    masked_store(
        o_ref,
        (split, row, head, pl.ds(0, block_h), slice(None)),
        out,
        mask=jnp.broadcast_to(h_ok[:, None], (block_h, head_dim)),
    )
    masked_store(lse_ref, (split, row, head, pl.ds(0, block_h)), lse, mask=h_ok)


def combine_splits(partial: jax.Array, lse: jax.Array, sink: jax.Array | None = None) -> jax.Array:
    """Merge ``[K, ...rows, D]`` partial outputs with base-2 LSEs ``[K, ...rows]``; a
    base-2 ``sink`` logit (broadcast to ``[...rows]``) joins the denominator once."""
    lse_max = jnp.max(lse, axis=0)
    if sink is not None:
        lse_max = jnp.maximum(lse_max, sink)
    lse_max = jnp.where(jnp.isfinite(lse_max), lse_max, 0.0)
    w = jnp.exp2(lse - lse_max[None])  # 0 for empty splits
    denom = jnp.sum(w, axis=0)
    if sink is not None:
        denom = denom + jnp.exp2(sink - lse_max)
    num = jnp.sum(w[..., None] * partial, axis=0)
    return num / jnp.where(denom == 0.0, 1.0, denom)[..., None]


def auto_num_splits(num_rows: int, num_kv_heads: int, max_blocks: int, pages_per_block: int) -> int:
    """Enough splits to launch ~TARGET_PROGRAMS programs, never more than the compute blocks."""
    want = -(-TARGET_PROGRAMS // max(1, num_rows * num_kv_heads))
    most = max(1, -(-max_blocks // pages_per_block))
    return max(1, min(want, most, MAX_AUTO_SPLITS))


@functools.partial(
    jax.jit,
    static_argnames=(
        "sm_scale",
        "interpret",
        "num_splits",
        "min_blocks_per_split",
        "pages_per_compute_block",
        "block_h",
        "num_warps",
        "num_stages",
        "sliding_window",
        "logit_soft_cap",
    ),
)
def paged_decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    interpret: bool = False,
    num_splits: int | None = None,
    min_blocks_per_split: int = MIN_BLOCKS_PER_SPLIT,
    pages_per_compute_block: int | None = None,
    block_h: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    sliding_window: int | None = None,
    logit_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Paged attention for pure-decode steps (every row has ``q_len`` 0 or 1).

    Arguments and result as in :func:`ragged_paged_attention`; knobs:

      num_splits: most KV splits per row (static grid size); default targets
        ~264 programs. Each row uses fewer when its live length is short.
      min_blocks_per_split: compute blocks a row's split gets at least; a row
        of ``n`` live blocks uses ``clip(ceil(n / this), 1, num_splits)`` splits.
      pages_per_compute_block: pages per inner-loop step (power of two);
        default makes a 128-token KV block (at least one page).
      block_h: query-head tile (power of two, >= 16 and >= the GQA group).
      num_warps, num_stages: Triton launch parameters.
      sliding_window, logit_soft_cap (static), sinks (``[Hq]`` float32): the
        contract's options (``reference.py``).
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
    if block_h is None:
        block_h = max(16, next_power_of_2(group))
    if not is_power_of_2(block_h) or block_h < group:
        raise ValueError(f"{block_h=} must be a power of two >= the query group ({group})")
    if pages_per_compute_block is None:
        pages_per_compute_block = max(1, 128 // block_size)
    if not is_power_of_2(pages_per_compute_block):
        raise ValueError(f"{pages_per_compute_block=} must be a power of two")
    check_dot_tile(rows=block_h, block_k=pages_per_compute_block * block_size)
    if num_splits is None:
        num_splits = auto_num_splits(num_rows, num_kv_heads, max_blocks, pages_per_compute_block)
    if num_splits < 1 or min_blocks_per_split < 1:
        raise ValueError(f"{num_splits=} and {min_blocks_per_split=} must be >= 1")

    q4 = q.reshape(num_tokens, num_kv_heads, group, head_dim)
    kernel = functools.partial(
        _decode_kernel,
        scale=float(sm_scale) * LOG2E,
        group=group,
        block_h=block_h,
        num_splits=num_splits,
        min_blocks_per_split=min_blocks_per_split,
        pages_per_block=pages_per_compute_block,
        block_size=block_size,
        max_len=max_blocks * block_size,
        sliding_window=sliding_window,
        soft_cap=None if logit_soft_cap is None else float(logit_soft_cap),
    )

    def whole(shape: tuple[int, ...]) -> pl.BlockSpec:
        origin = (0,) * len(shape)
        return pl.BlockSpec(shape, lambda s, h, k: origin)

    pool_spec = pl.BlockSpec(
        (SQUEEZED, num_pages, block_size, head_dim), lambda s, h, k: (h, 0, 0, 0)
    )
    operands = (
        num_seqs.astype(jnp.int32).reshape(1),
        cu_q_lens.astype(jnp.int32),
        kv_lens.astype(jnp.int32),
        block_tables.astype(jnp.int32),
        q4,
        k_pages,
        v_pages,
    )
    part_shape = (num_splits, num_rows, num_kv_heads, group, head_dim)
    partial, lse = pl.pallas_call(
        kernel,
        grid=(num_rows, num_kv_heads, num_splits),
        in_specs=[whole(x.shape) for x in operands[:5]] + [pool_spec, pool_spec],
        out_specs=[whole(part_shape), whole(part_shape[:-1])],
        out_shape=[
            jax.ShapeDtypeStruct(part_shape, jnp.float32),
            jax.ShapeDtypeStruct(part_shape[:-1], jnp.float32),
        ],
        interpret=interpret,
        compiler_params=triton_compiler_params(num_warps, num_stages),
        name=f"paged_decode_attention_k{num_splits}_pp{pages_per_compute_block}",
    )(*operands)

    sink = None
    if sinks is not None:
        sink = (sinks.astype(jnp.float32) * LOG2E).reshape(1, num_kv_heads, group)
    rows_out = combine_splits(partial, lse, sink).reshape(num_rows, num_q_heads, head_dim)
    row_ids = jnp.arange(num_rows, dtype=jnp.int32)
    live = (row_ids < num_seqs[0]) & (cu_q_lens[1:] > cu_q_lens[:-1])
    dest = jnp.where(live, cu_q_lens[:-1], num_tokens)  # out of range -> dropped
    out = jnp.zeros((num_tokens, num_q_heads, head_dim), q.dtype)
    return out.at[dest].set(rows_out.astype(q.dtype), mode="drop")
