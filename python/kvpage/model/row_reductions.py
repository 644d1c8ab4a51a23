"""Reductions along a row whose result must not depend on the other rows.

Owns :func:`mean_of_squares` (RMSNorm's statistic), :func:`log_softmax` (logprobs,
sampled and scored) and :func:`first_max_index` (greedy tokens; exact, so it needs no
care). XLA:CPU picks a row's reduction order from the shape of the whole array: RMSNorm
over 64 features changed in the last bit from 16 rows on, and over Qwen2.5's 896 a row
alone and the same row among 4, 8 or 16 differed for a quarter of the rows tried. A
norm that depends on the step's other rows makes a speculative verification (a
sequence's next token plus its drafts in one step) compute a token differently from the
decode step that would have computed it without speculation, so greedy outputs could
change on a near-tie, and it makes ``batch_invariant`` logprobs depend on the batch.

* :func:`mean_of_squares` sums each row by pairwise halving (:func:`tree_row_sums`):
  elementwise adds of the row's two halves, zero-padded to a power of two, so every
  sum is the same tree of float32 adds whatever the array's shape or fusion (measured
  as fast as ``jnp.mean`` for 1-2048 rows of 896).
* :func:`log_softmax` runs one row at a time (``lax.map``) up to
  :data:`INVARIANT_LOG_SOFTMAX_ROWS` rows, ``jax.nn.log_softmax`` above (the halving
  tree cost 3x at 64 rows of 151,936). Inside a batch-invariant trace every row sum goes
  through the Rust matmul kernel as a product with a row of ones, whose summation order
  depends only on the row's length, at every row count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvpage.model.linear_kernels import batch_invariant_enabled, matmul_nt


def _row_sums(x: jax.Array) -> jax.Array:
    """float32 sums of ``x`` over its last axis (kept), order fixed by its length."""
    flat = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
    sums = matmul_nt(flat, jnp.ones((1, x.shape[-1]), jnp.float32))
    return sums.reshape(*x.shape[:-1], 1)


def tree_row_sums(x: jax.Array) -> jax.Array:
    """Sums of ``x`` over its last axis (kept) by pairwise halving: the row is
    zero-padded to a power of two, then its first half is added to its second until one
    element is left. Each step is an elementwise add of two elements, which XLA does
    not reassociate, so a row's sum has one order whatever the array's shape
    (XLA:CPU's own reductions take their order from it)."""
    n = x.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, width - n)])
    while x.shape[-1] > 1:
        half = x.shape[-1] // 2
        x = x[..., :half] + x[..., half:]
    return x


def mean_of_squares(x: jax.Array) -> jax.Array:
    """``mean(x * x)`` over the last axis, keeping it; a row's value never depends on
    the other rows (:func:`tree_row_sums`)."""
    return tree_row_sums(x * x) / x.shape[-1]


INVARIANT_LOG_SOFTMAX_ROWS = 32
"""Outside a batch-invariant trace, arrays of at most this many rows take
:func:`log_softmax` one row at a time (the host quantized kernels' integer path, whose
rows are independent, also reaches 32 rows), so a speculative verification reports a
kept token's logprob with the decode step's bits. ``jax.nn.log_softmax`` over 300 and
4,096 entries gave 18 and 3 of 8 rows other bits among 2-64 rows. Row by row costs 0-0.6
ms at 1-8 rows of 151,936 and would cost ~30 % at 64 (2026-11-28, benches/RESULTS.md)."""


def log_softmax(x: jax.Array) -> jax.Array:
    """``jax.nn.log_softmax(x, axis=-1)`` of a 2-D array; a row's value does not depend
    on the other rows up to :data:`INVARIANT_LOG_SOFTMAX_ROWS` rows (always, in a
    batch-invariant trace)."""
    if not batch_invariant_enabled():
        if x.shape[0] > INVARIANT_LOG_SOFTMAX_ROWS:
            return jax.nn.log_softmax(x, axis=-1)
        # One compiled row body for every row: its reductions cannot take an order
        # from the row count.
        return jax.lax.map(lambda row: jax.nn.log_softmax(row, axis=-1), x)
    shifted = x - jax.lax.stop_gradient(jnp.max(x, axis=-1, keepdims=True))
    return shifted - jnp.log(_row_sums(jnp.exp(shifted)))


FIRST_MAX_TWO_PASS_ELEMENTS = 1 << 22
"""Arrays of at most this many elements take :func:`first_max_index`'s two passes; larger
ones ``jnp.argmax``. XLA:CPU runs ``argmax`` as a reduction over (value, index) pairs, one
element at a time: 234 us for one row of SmolLM2's 49,152 logits, 3.3 ms for 32 rows,
669 us for one row of Qwen2.5's 151,936. A max and then a min over the indices that hold
it are plain reductions: 46 us, 612 us and 124 us (4-5x; 2026-11-28, benches/RESULTS.md).
From ~4.7M elements (96 rows of 49,152) the second pass fell off XLA's fast reduction
(12.8 ms against argmax's 9.6 ms), so larger arrays keep ``argmax``."""


def first_max_index(x: jax.Array) -> jax.Array:
    """int32 ``jnp.argmax(x, axis=-1)`` of a 2-D float array: each row's first maximum,
    or its first NaN where it has one (an all ``-inf`` row gives 0). Exact, so a row's
    result never depends on the other rows."""
    if x.size > FIRST_MAX_TWO_PASS_ELEMENTS:
        return jnp.argmax(x, axis=-1).astype(jnp.int32)
    top = jnp.max(x, axis=-1, keepdims=True)  # NaN where the row holds one
    n = x.shape[-1]
    hit = (x == top) | jnp.isnan(x)
    return jnp.min(jnp.where(hit, jnp.arange(n, dtype=jnp.int32), n), axis=-1)
