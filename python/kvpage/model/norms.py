"""RMSNorm, the one normalisation of every supported architecture.

Owns :func:`rms_norm` (its statistic: :func:`kvpage.model.row_reductions.mean_of_squares`).
Statistics are float32; the result has ``x``'s dtype. With
``offset`` 0 (Llama family) the normalised values are cast to ``x``'s dtype and then
scaled by ``weight``, as transformers' ``LlamaRMSNorm`` does; with an offset (Gemma's
``1 + weight``) the scaling happens in float32 before the cast, as ``GemmaRMSNorm`` does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvpage.model.row_reductions import mean_of_squares


def rms_norm(x: jax.Array, weight: jax.Array, eps: float, offset: float = 0.0) -> jax.Array:
    """RMSNorm of ``x`` over its last axis, scaled by ``offset + weight``."""
    xf = x.astype(jnp.float32)
    normed = xf * jax.lax.rsqrt(mean_of_squares(xf) + eps)
    if offset:
        return (normed * (offset + weight.astype(jnp.float32))).astype(x.dtype)
    return weight * normed.astype(x.dtype)
