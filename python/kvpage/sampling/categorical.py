"""Drawing one token per row from ``softmax(logits)``: a two-level inverse CDF.

Owns :func:`draw_categorical`. The textbook ways are slow on a CPU at decode batch sizes:
Gumbel-max needs one random number per vocabulary entry (``[rows, vocab]`` threefry
draws: 64 ms for 128 rows of a 49k vocabulary, a sixth of a SmolLM2 decode step), and a
flat inverse CDF needs a cumulative sum over the vocabulary (41 ms: XLA:CPU's
``cumsum`` is a reduce-window). Here the vocabulary is cut into chunks of
:data:`CHUNK` entries: one ``exp`` pass and a sum per chunk, a cumulative sum over the
few hundred chunk masses to find the chunk a uniform draw lands in, then a cumulative
sum inside that one chunk (3.8 ms for the same batch; ``benches/RESULTS.md``, "RL
rollouts"). One uniform number per row.

Invariants: the drawn token has positive probability (a masked, ``-inf`` logit is never
drawn, even when float rounding puts the draw past the last cumulative value: the draw
then falls back to the last token of positive mass); each row depends only on its own
logits and key.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

CHUNK = 256
"""Vocabulary entries per chunk (49152 / 256 = 192 chunks for SmolLM2)."""


def _first_above(cumulative: jax.Array, target: jax.Array, mass: jax.Array) -> jax.Array:
    """Per row, the first index whose cumulative value exceeds ``target``; past the end
    (rounding), the last index with positive ``mass``."""
    n = cumulative.shape[-1]
    above = cumulative > target[:, None]
    first = jnp.argmax(above, axis=-1)
    last_positive = n - 1 - jnp.argmax((mass > 0)[:, ::-1], axis=-1)
    return jnp.where(jnp.any(above, axis=-1), first, last_positive)


def draw_categorical(logits: jax.Array, keys: jax.Array) -> jax.Array:
    """int32 ``[rows]``: one token per row of float ``logits [rows, vocab]`` with
    probability ``softmax(logits)``, using one uniform draw from each row's key."""
    rows, vocab = logits.shape
    chunks = -(-vocab // CHUNK)
    padded = jnp.pad(logits.astype(jnp.float32), ((0, 0), (0, chunks * CHUNK - vocab)),
                     constant_values=-jnp.inf)
    top = jnp.max(padded, axis=-1, keepdims=True)
    weights = jnp.exp(padded - top).reshape(rows, chunks, CHUNK)
    chunk_mass = weights.sum(axis=-1)
    chunk_cumulative = jnp.cumsum(chunk_mass, axis=-1)
    uniform = jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(keys)
    target = uniform * chunk_cumulative[:, -1]
    chunk = _first_above(chunk_cumulative, target, chunk_mass)
    below = jnp.take_along_axis(chunk_cumulative, chunk[:, None], axis=-1)[:, 0] - (
        jnp.take_along_axis(chunk_mass, chunk[:, None], axis=-1)[:, 0]
    )
    inside = jnp.take_along_axis(weights, chunk[:, None, None], axis=1)[:, 0]
    offset = _first_above(jnp.cumsum(inside, axis=-1), target - below, inside)
    return (chunk * CHUNK + offset).astype(jnp.int32)
