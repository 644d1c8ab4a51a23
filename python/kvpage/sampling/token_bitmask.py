"""Grammar token masks on the device: packed bitmasks in, masked logits out.

This file owns the bitmask format the runner accepts (``StepPlan.token_bitmask``) and
its application inside the jitted step. A row of ``ceil(vocab / 32)`` int32 words allows
token ``t`` iff bit ``t % 32`` of word ``t // 32`` is set (the layout the Rust core's
``Scheduler.fill_token_bitmask`` writes). A row of all ones (-1 words) allows every
token: unconstrained rows and padded rows use it, and a step without any constrained
row skips the masking (``lax.cond``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

ALLOW_ALL = -1
"""An int32 word with all 32 bits set."""


def bitmask_words(vocab_size: int) -> int:
    """int32 words per row for ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def pad_bitmask(bitmask: np.ndarray, rows: int, vocab_size: int) -> np.ndarray:
    """``bitmask [S', words]`` padded with allow-all rows to ``rows`` rows."""
    words = bitmask_words(vocab_size)
    bitmask = np.asarray(bitmask, np.int32)
    if bitmask.ndim != 2 or bitmask.shape[1] != words or bitmask.shape[0] > rows:
        raise ValueError(
            f"token_bitmask must be int32 [<= {rows}, {words}] for a vocabulary of "
            f"{vocab_size}, got shape {bitmask.shape}"
        )
    out = np.full((rows, words), ALLOW_ALL, np.int32)
    out[: bitmask.shape[0]] = bitmask
    return out


def allowed_tokens(bitmask: jax.Array, vocab_size: int) -> jax.Array:
    """bool ``[N, vocab_size]``: which tokens each row's bitmask allows."""
    shifts = jnp.arange(32, dtype=jnp.int32)
    bits = (bitmask[:, :, None] >> shifts) & 1  # arithmetic shift; bit 31 still reads right
    return bits.reshape(bitmask.shape[0], -1)[:, :vocab_size] != 0


def apply_token_bitmask(logits: jax.Array, bitmask: jax.Array) -> jax.Array:
    """Logits of disallowed tokens become -inf (skipped when every word is -1)."""

    def mask(x: jax.Array) -> jax.Array:
        return jnp.where(allowed_tokens(bitmask, x.shape[-1]), x, -jnp.inf)

    return jax.lax.cond(jnp.any(bitmask != ALLOW_ALL), mask, lambda x: x, logits)
