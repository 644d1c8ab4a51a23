"""Pure-jnp reference of the ragged paged-attention contract.

This file *is* the contract. Every kernel in this package must match it.

Shapes (T tokens this step, S sequence rows, Hq query heads, Hkv KV heads,
D head dim, P physical blocks in the device pool, B block size):

    q             [T, Hq, D]        new queries, flattened over sequences
    k_pages       [Hkv, P, B, D]    one layer's K pool (V pool identical)
    kv_lens       [S] int32         KV length of each row *after* this step
    block_tables  [S, max_blocks]   physical block of each logical block
    cu_q_lens     [S + 1] int32     row s owns query tokens cu_q_lens[s]:cu_q_lens[s+1]
    num_seqs      [1] int32         rows >= num_seqs are padding

Row s has q_len = cu_q_lens[s+1] - cu_q_lens[s] queries. They are the last
q_len tokens of its kv_len tokens, so query i of row s sits at position
kv_len - q_len + i and attends causally to KV positions 0 ..= that position.
Padded rows have q_len = 0 and kv_len = 0. Padded tokens (index >=
cu_q_lens[num_seqs]) produce zeros. Entries of a block table past
ceil(kv_len / B) may hold any in-range block id and must never be read; KV
slots at or past kv_len may hold garbage (NaN, inf) and must never be read.

GQA: query head h reads KV head h // (Hq // Hkv).

Optional features (keyword arguments of every backend; ``None`` = off, and then no
backend traces any extra work for them):

* ``sliding_window`` (static int W >= 1): query at position p attends only KV positions
  j with ``p - W < j <= p`` (transformers' ``sliding_window_overlay``: the window counts
  the token itself). A block that lies wholly below the window of every query of its
  row (``(block + 1) * B <= p_first - W + 1``, ``p_first`` the row's first query
  position) is *outside the window*: its block-table entry may hold any in-range id
  (the scheduler frees such blocks; the entry may point at the scratch block or a
  block reused by another sequence) and neither the entry's block nor its contents
  may affect the output. The kernels skip such blocks (their KV loops start at the
  first block the window touches); the reference masks them (its gather is by
  table, and ``jnp.where`` keeps their garbage out).
* ``logit_soft_cap`` (static float c > 0): Gemma 2's soft-capping,
  ``score = c * tanh((q . k * sm_scale) / c)``, applied before masking and softmax.
* ``sinks`` (float32 ``[Hq]`` array, traced): gpt-oss attention sinks; one logit per
  query head joins the softmax denominator (softmax over ``[scores..., sink]``, the
  sink column then dropped), so ``out = sum_j e^(s_j) v_j / (sum_j e^(s_j) + e^sink)``.
  The sink is not soft-capped. A token with nothing visible (padding) still gets 0.

The device pool holds one scratch block past the blocks the Rust core
manages (id P - 1 = num_blocks); padded tokens write their K/V there.
"""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp


def ragged_paged_attention_reference(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    cu_q_lens: jax.Array,
    num_seqs: jax.Array,
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    logit_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Attention of every query token over its own sequence's paged KV."""
    check_attention_options(sliding_window, logit_soft_cap, sinks, q.shape[1])
    num_tokens, num_q_heads, head_dim = q.shape
    num_kv_heads, _, block_size, _ = k_pages.shape
    num_rows, max_blocks = block_tables.shape
    group = num_q_heads // num_kv_heads
    max_len = max_blocks * block_size

    token_idx = jnp.arange(num_tokens, dtype=jnp.int32)
    # Row of each token: the last row whose start is <= the token index.
    row = jnp.searchsorted(cu_q_lens[1:], token_idx, side="right").astype(jnp.int32)
    row = jnp.minimum(row, num_rows - 1)
    is_real = token_idx < cu_q_lens[num_seqs[0]]
    q_len = cu_q_lens[row + 1] - cu_q_lens[row]
    q_pos = kv_lens[row] - q_len + (token_idx - cu_q_lens[row])

    # Gather each row's KV into logical order: [S, max_len, Hkv, D].
    def gather(pages: jax.Array) -> jax.Array:
        blocks = pages[:, block_tables]  # [Hkv, S, max_blocks, B, D]
        blocks = blocks.reshape(num_kv_heads, num_rows, max_len, head_dim)
        return blocks.transpose(1, 2, 0, 3)

    k = gather(k_pages)[row].astype(jnp.float32)  # [T, L, Hkv, D]
    v = gather(v_pages)[row].astype(jnp.float32)
    qf = q.astype(jnp.float32).reshape(num_tokens, num_kv_heads, group, head_dim)
    scores = jnp.einsum("thgd,tlhd->thgl", qf, k) * sm_scale
    if logit_soft_cap is not None:
        scores = logit_soft_cap * jnp.tanh(scores / logit_soft_cap)

    kv_pos = jnp.arange(max_len, dtype=jnp.int32)
    visible = (kv_pos[None, :] <= q_pos[:, None]) & (kv_pos[None, :] < kv_lens[row][:, None])
    if sliding_window is not None:
        visible = visible & (kv_pos[None, :] > q_pos[:, None] - sliding_window)
    visible = visible & is_real[:, None]
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    # Rows with nothing visible (padding) get zeros rather than NaN.
    max_score = jnp.max(scores, axis=-1, keepdims=True)
    if sinks is not None:
        sink = sinks.astype(jnp.float32).reshape(1, num_kv_heads, group, 1)
        max_score = jnp.maximum(max_score, sink)
    max_score = jnp.where(jnp.isfinite(max_score), max_score, 0.0)
    weights = jnp.exp(scores - max_score)
    weights = jnp.where(visible[:, None, None, :], weights, 0.0)
    denom = jnp.sum(weights, axis=-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sink - max_score)
    weights = weights / jnp.where(denom == 0.0, 1.0, denom)
    # Garbage (NaN/inf) in unread slots must not leak through 0 * NaN.
    v = jnp.where(jnp.isfinite(v), v, 0.0)
    out = jnp.einsum("thgl,tlhd->thgd", weights, v)
    return out.reshape(num_tokens, num_q_heads, head_dim).astype(q.dtype)


def check_attention_options(
    sliding_window: int | None,
    logit_soft_cap: float | None,
    sinks: jax.Array | None,
    num_q_heads: int,
) -> None:
    """ValueError for a window < 1, a cap <= 0 or sinks that are not ``[Hq]``."""
    if sliding_window is not None and operator.index(sliding_window) < 1:
        raise ValueError(f"sliding_window must be an int >= 1 or None, got {sliding_window!r}")
    if logit_soft_cap is not None and not float(logit_soft_cap) > 0.0:
        raise ValueError(f"logit_soft_cap must be > 0 or None, got {logit_soft_cap!r}")
    if sinks is not None and tuple(sinks.shape) != (num_q_heads,):
        raise ValueError(f"sinks must have shape ({num_q_heads},), got {tuple(sinks.shape)}")


def window_start(first_pos: jax.Array, sliding_window: int | None) -> jax.Array:
    """First KV position the window of a query at ``first_pos`` can see (0 without one)."""
    if sliding_window is None:
        return jnp.zeros_like(first_pos)
    return jnp.maximum(first_pos - (sliding_window - 1), 0)


def write_kv_pages(
    k_pages: jax.Array,
    v_pages: jax.Array,
    k: jax.Array,
    v: jax.Array,
    slot_mapping: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Scatter new K/V ([T, Hkv, D]) into the pools at ``slot = block * B + offset``."""
    num_kv_heads, num_blocks, block_size, head_dim = k_pages.shape

    def scatter(pages: jax.Array, new: jax.Array) -> jax.Array:
        flat = pages.reshape(num_kv_heads, num_blocks * block_size, head_dim)
        flat = flat.at[:, slot_mapping].set(new.transpose(1, 0, 2).astype(pages.dtype))
        return flat.reshape(pages.shape)

    return scatter(k_pages, k), scatter(v_pages, v)
