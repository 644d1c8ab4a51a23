"""Reductions along a row whose result must not depend on the other rows.

Owns :func:`mean_of_squares` (RMSNorm's statistic) and :func:`log_softmax` (logprobs,
sampled and scored). Outside a batch-invariant trace they are ``jnp``'s. Inside one
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
