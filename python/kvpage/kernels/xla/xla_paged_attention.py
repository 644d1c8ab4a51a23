"""Paged attention in plain XLA whose work follows the live KV, not the table width.

Owns :func:`xla_paged_attention`, the default backend off-GPU (CPU, and anywhere the
Pallas kernels do not compile). Same contract as ``reference.py``; the reference
gathers a per-token copy of the whole padded table (``[T, max_blocks * B, Hkv, D]``),
so its FLOPs and scratch follow ``max_model_len``. This one is flash attention written
with ``lax`` loops whose trip counts are read from the step's live lengths:

* On CPU, every query token of a row (sequence) with up to
  :data:`HOST_KERNEL_MAX_TOKENS` query tokens in the step is a row of kvpage's Rust
  decode kernel (``cpu_decode_attention.py``: XLA:CPU's gather of paged blocks is slow):
  a prefill chunk's token ``i`` reads its sequence's first ``context + i + 1`` positions,
  so a speculative verification's rows and a prompt's equal what decode steps at those
  positions would give. Against the ``lax`` loops below, per layer of Qwen2.5-0.5B's
  shape (14 query / 2 KV heads of 64), 2026-11-28 (``benches/RESULTS.md``): 8 tokens of
  one sequence at 600 positions 0.41 vs 0.58 ms, 64 tokens of 8 sequences 1.46 vs 16.8
  ms, 128 tokens of one at 1,000 positions 4.4 vs 7.7 ms. Only longer rows (long prompt
  chunks) go to the loops below, whose ``q_tile`` queries share each K/V chunk. The
  choice is per row, not per step: 32 prompts of 32 tokens in one step, which the loops
  took one 128-query tile each, cost 26 ms of attention a layer there (2026-11-28).
* Elsewhere (and with ``host_decode_kernel=False``), decode rows are
  computed together by one loop over KV chunks of ``decode_chunk_blocks`` blocks, trip
  count ``ceil(max decode kv_len / chunk)``; each iteration gathers ``[S, chunk]`` K/V
  and updates an online softmax per row.
* Rows with ``q_len > 1`` (prefill chunks) are looped over one at a time (trip count:
  how many there are), their queries in tiles of ``q_tile`` tokens, and each tile
  over the KV chunks (``kv_chunk_blocks`` blocks) its causal window reaches
  (``ceil(last visible position / chunk)``).

So a step reads and computes ``O(sum over rows of q_len x kv_len)`` (at chunk
granularity) and its scratch is ``O(S x chunk + q_tile x chunk)``, whatever
``max_model_len`` is; the compiled executable does not depend on the live lengths, so
no extra buckets are needed. Slots at or past ``kv_len`` may hold garbage (NaN, inf):
they are masked out of both the scores and the values.

Sliding window, soft-cap, sinks (contract: ``reference.py``). With ``sliding_window``
each decode row's chunk loop starts at the first block its window touches (a per-row
offset into its table: ``take_along_axis`` instead of one ``dynamic_slice``), and each
prefill tile's at the first block its first query's window touches; so a block wholly
outside the window is never gathered, and its table entry never used as an index. The
trip counts follow ``min(kv_len, window)``. Slots of the first block below the window
are masked out of the scores only: they were written, so they are finite, and values
are masked only at or past ``kv_len`` - so a wholly-outside block that *were* gathered
would leak its garbage (the tests poison them to prove none is). ``logit_soft_cap`` caps
each score tile before the mask; ``sinks`` join the denominator once, when the running
softmax is finished. With all three ``None`` the traced program is the one without them.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax

from kvpage.kernels.host import cpu_decode_attention
from kvpage.kernels.host.cpu_decode_attention import cpu_paged_decode_attention
from kvpage.kernels.xla.reference import check_attention_options, window_start

DEFAULT_KV_CHUNK_BLOCKS = 8
"""KV blocks per chunk for prefill tiles (a ``[q_tile, chunk]`` score tile)."""
DEFAULT_DECODE_CHUNK_BLOCKS = 2
"""KV blocks per chunk for decode rows; small chunks keep the ``[S, chunk]`` gather in
cache (measured fastest on a 2-core x86 CPU at 64 rows x 100 and x 1000 tokens)."""
DEFAULT_Q_TILE = 128
HOST_KERNEL_MAX_TOKENS = 256
"""Rows with up to this many query tokens in a step run every token as a host-kernel row
(module docs); longer ones (long prompt chunks) the ``lax`` loops, whose ``q_tile``
queries share each K/V chunk: a 512-token chunk at 1,500 positions took 24-25 ms there
against 29-32 per token, a 2,048-token prompt 57-62 against 68-71 (Qwen2.5-0.5B's heads,
per layer, 2026-11-28). A step of at most this many tokens has no longer row, and its
program no loops."""


def _ceil_div(a: jax.Array, b: int) -> jax.Array:
    return (a + b - 1) // b


def _online_update(
    carry: tuple[jax.Array, jax.Array, jax.Array],
    scores: jax.Array,
    visible: jax.Array,
    values: jax.Array,
    pv_spec: str,
    soft_cap: float | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One flash-attention step: fold ``scores [..., K]`` and ``values`` into the
    running max ``m``, denominator ``l`` and accumulator ``acc``."""
    m, l_sum, acc = carry
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    scores = jnp.where(visible, scores, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(scores, axis=-1))
    m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
    p = jnp.exp(scores - m_safe[..., None])
    alpha = jnp.exp(m - m_safe)
    l_sum = l_sum * alpha + jnp.sum(p, axis=-1)
    acc = acc * alpha[..., None] + jnp.einsum(pv_spec, p, values)
    return m_new, l_sum, acc


def _finish(
    m: jax.Array, l_sum: jax.Array, acc: jax.Array, sink: jax.Array | None = None
) -> jax.Array:
    """``acc / l``; with a ``sink`` logit (broadcast like ``m``) it joins the denominator."""
    if sink is not None:
        m_new = jnp.maximum(m, sink)
        m_safe = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
        alpha = jnp.exp(m - m_safe)
        l_sum = l_sum * alpha + jnp.exp(sink - m_safe)
        acc = acc * alpha[..., None]
    return acc / jnp.where(l_sum == 0.0, 1.0, l_sum)[..., None]


def _decode_rows(
    q: jax.Array,  # [Hkv, S, G, D] float32, pre-scaled
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,  # [S], 0 for rows not computed here
    block_tables: jax.Array,  # [S, M], M a multiple of chunk_blocks
    chunk_blocks: int,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,  # [Hkv, G] float32
) -> jax.Array:
    num_kv_heads, num_rows, group, head_dim = q.shape
    block_size = k_pages.shape[2]
    width = block_tables.shape[1]
    chunk = chunk_blocks * block_size
    if sliding_window is None:
        num_chunks = _ceil_div(jnp.max(kv_lens), chunk)
    else:  # each row starts at the first block its window touches
        start = window_start(kv_lens - 1, sliding_window)  # [S]
        first_block = start // block_size
        num_chunks = _ceil_div(jnp.max(kv_lens - first_block * block_size), chunk)

    def body(c: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]):
        if sliding_window is None:
            ids = lax.dynamic_slice_in_dim(block_tables, c * chunk_blocks, chunk_blocks, axis=1)
            kv_pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
            live = kv_pos[None, :] < kv_lens[:, None]  # [S, chunk]
        else:
            block = first_block + c * chunk_blocks  # [S]
            cols = block[:, None] + jnp.arange(chunk_blocks, dtype=jnp.int32)[None, :]
            # Columns past the table are clamped; their slots are past kv_len (masked).
            ids = jnp.take_along_axis(block_tables, jnp.minimum(cols, width - 1), axis=1)
            kv_pos = block[:, None] * block_size + jnp.arange(chunk, dtype=jnp.int32)[None, :]
            live = kv_pos < kv_lens[:, None]
        k = k_pages[:, ids].reshape(num_kv_heads, num_rows, chunk, head_dim)
        v = v_pages[:, ids].reshape(num_kv_heads, num_rows, chunk, head_dim)
        v = jnp.where(live[None, :, :, None], v.astype(jnp.float32), 0.0)
        visible = live if sliding_window is None else live & (kv_pos >= start[:, None])
        # (KV head, row) leading: XLA:CPU runs these batched dots fastest.
        scores = jnp.einsum("hsgd,hskd->hsgk", q, k.astype(jnp.float32))
        return _online_update(
            carry, scores, visible[None, :, None, :], v, "hsgk,hskd->hsgd", soft_cap
        )

    init = (
        jnp.full((num_kv_heads, num_rows, group), -jnp.inf, jnp.float32),
        jnp.zeros((num_kv_heads, num_rows, group), jnp.float32),
        jnp.zeros((num_kv_heads, num_rows, group, head_dim), jnp.float32),
    )
    m, l_sum, acc = lax.fori_loop(0, num_chunks, body, init)
    return _finish(m, l_sum, acc, None if sinks is None else sinks[:, None, :])


def _prefill_rows(
    q: jax.Array,  # [T + q_tile, Hkv, G, D] float32, pre-scaled, zero-padded at the end
    k_pages: jax.Array,
    v_pages: jax.Array,
    rows: jax.Array,  # [S] row ids to compute, first `num_rows` valid
    num_rows: jax.Array,  # scalar
    q_starts: jax.Array,  # [S]
    q_lens: jax.Array,  # [S]
    kv_lens: jax.Array,  # [S]
    block_tables: jax.Array,  # [S, M]; with a window, >= chunk_blocks columns of padding
    chunk_blocks: int,
    q_tile: int,
    *,
    sliding_window: int | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,  # [Hkv, G] float32
) -> jax.Array:
    _, num_kv_heads, group, head_dim = q.shape
    block_size = k_pages.shape[2]
    chunk = chunk_blocks * block_size
    tile_shape = (q_tile, num_kv_heads, group, head_dim)

    def row_body(i: jax.Array, out: jax.Array) -> jax.Array:
        row = rows[i]
        start, q_len, kv_len = q_starts[row], q_lens[row], kv_lens[row]
        context = kv_len - q_len
        table = block_tables[row]

        def tile_body(j: jax.Array, out: jax.Array) -> jax.Array:
            first = start + j * q_tile
            q_tile_vals = lax.dynamic_slice(q, (first, 0, 0, 0), tile_shape)
            offset = j * q_tile + jnp.arange(q_tile, dtype=jnp.int32)
            q_pos = context + offset
            q_valid = offset < q_len
            kv_end = jnp.minimum(context + (j + 1) * q_tile, kv_len)
            # The tile's first query sees the lowest position; blocks wholly below it
            # are skipped (without a window: none).
            if sliding_window is not None:
                win_start = window_start(context + j * q_tile, sliding_window)
                first_block = win_start // block_size

            def kv_body(c: jax.Array, carry: tuple[jax.Array, jax.Array, jax.Array]):
                if sliding_window is None:
                    ids = lax.dynamic_slice_in_dim(table, c * chunk_blocks, chunk_blocks)
                    kv_pos = c * chunk + jnp.arange(chunk, dtype=jnp.int32)
                else:
                    block = first_block + c * chunk_blocks
                    ids = lax.dynamic_slice_in_dim(table, block, chunk_blocks)
                    kv_pos = block * block_size + jnp.arange(chunk, dtype=jnp.int32)
                k = k_pages[:, ids].reshape(num_kv_heads, chunk, head_dim)
                v = v_pages[:, ids].reshape(num_kv_heads, chunk, head_dim)
                live = kv_pos < kv_len
                v = jnp.where(live[None, :, None], v.astype(jnp.float32), 0.0)
                visible = (kv_pos[None, :] <= q_pos[:, None]) & live[None, :]
                if sliding_window is not None:
                    visible = visible & (kv_pos[None, :] > q_pos[:, None] - sliding_window)
                scores = jnp.einsum("qhgd,hkd->qhgk", q_tile_vals, k.astype(jnp.float32))
                return _online_update(
                    carry, scores, visible[:, None, None, :], v, "qhgk,hkd->qhgd", soft_cap
                )

            init = (
                jnp.full(tile_shape[:3], -jnp.inf, jnp.float32),
                jnp.zeros(tile_shape[:3], jnp.float32),
                jnp.zeros(tile_shape, jnp.float32),
            )
            if sliding_window is None:
                trips = _ceil_div(kv_end, chunk)
            else:
                trips = _ceil_div(kv_end - first_block * block_size, chunk)
            m, l_sum, acc = lax.fori_loop(0, trips, kv_body, init)
            finished = _finish(m, l_sum, acc, None if sinks is None else sinks[None])
            current = lax.dynamic_slice(out, (first, 0, 0, 0), tile_shape)
            result = jnp.where(q_valid[:, None, None, None], finished, current)
            return lax.dynamic_update_slice(out, result, (first, 0, 0, 0))

        return lax.fori_loop(0, _ceil_div(q_len, q_tile), tile_body, out)

    return lax.fori_loop(0, num_rows, row_body, jnp.zeros_like(q))


def token_rows(
    num_tokens: int,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Each query token as a decode row: its KV length (its position + 1; 0 for padding
    tokens) and its sequence's row of the block tables."""
    num_rows = block_tables.shape[0]
    tokens = jnp.arange(num_tokens, dtype=jnp.int32)
    rows = jnp.clip(jnp.searchsorted(cu_q_lens, tokens, side="right") - 1, 0, num_rows - 1)
    live = tokens < cu_q_lens[num_seqs[0]]
    # The row's last token sees kv_len positions; each earlier one, one fewer.
    token_kv = kv_lens[rows] - (cu_q_lens[rows + 1] - 1 - tokens)
    return jnp.where(live, token_kv, 0).astype(jnp.int32), rows.astype(jnp.int32)


def xla_paged_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    decode_only: bool = False,
    kv_chunk_blocks: int = DEFAULT_KV_CHUNK_BLOCKS,
    decode_chunk_blocks: int = DEFAULT_DECODE_CHUNK_BLOCKS,
    q_tile: int = DEFAULT_Q_TILE,
    host_decode_kernel: bool = True,
    sliding_window: int | None = None,
    logit_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Ragged paged attention (contract: ``reference.py``) with live-length loops.

    ``sliding_window``, ``logit_soft_cap``, ``sinks``: as in ``reference.py``.

    ``host_decode_kernel``: on CPU, every query token of a row with at most
    :data:`HOST_KERNEL_MAX_TOKENS` query tokens is a decode row of kvpage's Rust kernel
    (``cpu_decode_attention.py``), reading its sequence's KV up to its own position,
    instead of the ``lax`` loops; same result (module docs).

    ``decode_only=True`` promises every live row has ``q_len <= 1`` and skips the
    prefill loop (it would run zero times anyway; the flag only shrinks the program).
    """
    check_attention_options(sliding_window, logit_soft_cap, sinks, q.shape[1])

    def in_lax(loop_rows: jax.Array | None = None) -> jax.Array:
        return _lax_attention(
            q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs,
            sm_scale=sm_scale, decode_only=decode_only, kv_chunk_blocks=kv_chunk_blocks,
            decode_chunk_blocks=decode_chunk_blocks, q_tile=q_tile,
            sliding_window=sliding_window, logit_soft_cap=logit_soft_cap, sinks=sinks,
            loop_rows=loop_rows,
        )  # fmt: skip

    if not host_decode_kernel or not cpu_decode_attention.available():
        return in_lax()
    if decode_only and q.shape[0] == block_tables.shape[0]:  # token r is row r
        live = jnp.arange(block_tables.shape[0], dtype=jnp.int32) < num_seqs[0]
        token_kv_lens, table_rows = jnp.where(live, kv_lens, 0).astype(jnp.int32), None
    else:
        token_kv_lens, table_rows = token_rows(
            q.shape[0], kv_lens, block_tables, cu_q_lens, num_seqs
        )
    host_only = decode_only or q.shape[0] <= HOST_KERNEL_MAX_TOKENS  # no longer row
    if not host_only:
        live_row = jnp.arange(block_tables.shape[0], dtype=jnp.int32) < num_seqs[0]
        long_row = live_row & (cu_q_lens[1:] - cu_q_lens[:-1] > HOST_KERNEL_MAX_TOKENS)
        in_loops = long_row[table_rows] & (token_kv_lens > 0)  # [T]
        token_kv_lens = jnp.where(in_loops, 0, token_kv_lens)
    out = cpu_paged_decode_attention(
        q, k_pages, v_pages, token_kv_lens, block_tables, sm_scale=sm_scale,
        otherwise=lambda: in_lax().astype(jnp.float32), sliding_window=sliding_window,
        logit_soft_cap=logit_soft_cap, sinks=sinks, table_rows=table_rows,
    )  # fmt: skip
    if not host_only:  # elsewhere than CPU, ``out`` is the loops' for every token already
        short_out = out
        out = lax.platform_dependent(
            cpu=lambda: jnp.where(
                in_loops[:, None, None], in_lax(long_row).astype(jnp.float32), short_out
            ),
            default=lambda: short_out,
        )
    return out.astype(q.dtype)


def _lax_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    decode_only: bool,
    kv_chunk_blocks: int,
    decode_chunk_blocks: int,
    q_tile: int,
    sliding_window: int | None,
    logit_soft_cap: float | None,
    sinks: jax.Array | None,
    loop_rows: jax.Array | None = None,
) -> jax.Array:
    """The ``lax`` loops: decode rows together, prefill rows one at a time. With
    ``loop_rows`` (bool ``[S]``) only those rows, each in the prefill loops; the other
    tokens' results are unspecified."""
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, num_pages, _, _ = k_pages.shape
    num_rows, width = block_tables.shape
    group = num_q_heads // num_kv_heads
    chunk_blocks = max(1, min(kv_chunk_blocks, width))
    decode_blocks = max(1, min(decode_chunk_blocks, width))
    multiple = chunk_blocks * decode_blocks // math.gcd(chunk_blocks, decode_blocks)
    padded_width = -(-width // multiple) * multiple
    if sliding_window is not None:
        # Prefill chunks start at a window's first block, not a multiple of the chunk:
        # a whole chunk past the table keeps their dynamic slices from being clamped.
        padded_width += chunk_blocks
    if padded_width != width:  # whole chunks only; the extra entries are never read
        block_tables = jnp.pad(
            block_tables, ((0, 0), (0, padded_width - width)), constant_values=num_pages - 1
        )

    live_row = jnp.arange(num_rows, dtype=jnp.int32) < num_seqs[0]
    q_starts = cu_q_lens[:-1]
    q_lens = jnp.where(live_row, cu_q_lens[1:] - q_starts, 0)
    kv_lens = jnp.where(live_row, kv_lens, 0)
    qf = (q.astype(jnp.float32) * sm_scale).reshape(num_tokens, num_kv_heads, group, head_dim)
    options = {"sliding_window": sliding_window, "soft_cap": logit_soft_cap}
    options["sinks"] = (
        None if sinks is None else sinks.astype(jnp.float32).reshape(num_kv_heads, group)
    )

    is_decode = q_lens == 1
    decode_tokens = jnp.clip(q_starts, 0, num_tokens - 1)
    decode_kv_lens = jnp.where(is_decode, kv_lens, 0)

    def decode_in_xla() -> jax.Array:  # [S, Hq, D]
        return (
            _decode_rows(
                qf[decode_tokens].transpose(1, 0, 2, 3),
                k_pages,
                v_pages,
                decode_kv_lens,
                block_tables,
                decode_blocks,
                **options,
            )
            .transpose(1, 0, 2, 3)
            .reshape(num_rows, num_q_heads, head_dim)
        )

    if decode_only:
        out = jnp.zeros_like(qf)
    else:
        tile = min(q_tile, num_tokens)
        padded_q = jnp.pad(qf, ((0, tile), (0, 0), (0, 0), (0, 0)))
        is_prefill = q_lens > 1 if loop_rows is None else loop_rows & live_row
        (prefill_rows,) = jnp.nonzero(is_prefill, size=num_rows, fill_value=0)
        out = _prefill_rows(
            padded_q,
            k_pages,
            v_pages,
            prefill_rows.astype(jnp.int32),
            jnp.sum(is_prefill),
            q_starts,
            q_lens,
            kv_lens,
            block_tables,
            chunk_blocks,
            tile,
            **options,
        )[:num_tokens]
    if loop_rows is None:
        decode_out = decode_in_xla().reshape(num_rows, num_kv_heads, group, head_dim)
        target = jnp.where(is_decode, decode_tokens, num_tokens)  # others: dropped
        out = out.at[target].set(decode_out, mode="drop")
    is_real = jnp.arange(num_tokens, dtype=jnp.int32) < cu_q_lens[num_seqs[0]]
    out = jnp.where(is_real[:, None, None, None], out, 0.0)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)
