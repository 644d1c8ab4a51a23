"""Reductions along a row whose result must not depend on the other rows.

Owns :func:`mean_of_squares` (RMSNorm's statistic), :func:`log_softmax` (logprobs,
sampled and scored) and :func:`first_max_index` (greedy tokens; exact, so it needs no
care). Outside a batch-invariant trace the first two are ``jnp``'s. Inside one
(:func:`kvpage.model.linear_kernels.batch_invariant`) every row sum goes through the
Rust matmul kernel as a product with a row of ones, whose summation order depends only
on the row's length: XLA:CPU picks a row's reduction order from the shape of the whole
array (RMSNorm over 64 features changed in the last bit from 16 rows on), which would
make a token's logprob depend on what else ran in its step. The log-softmax's sum is a
row reduction of the same kind, so it takes the same route.
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


def mean_of_squares(x: jax.Array) -> jax.Array:
    """``mean(x * x)`` over the last axis, keeping it."""
    if not batch_invariant_enabled():
        return jnp.mean(x * x, axis=-1, keepdims=True)
    return _row_sums(x * x) / x.shape[-1]


def log_softmax(x: jax.Array) -> jax.Array:
    """``jax.nn.log_softmax(x, axis=-1)``."""
    if not batch_invariant_enabled():
        return jax.nn.log_softmax(x, axis=-1)
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
