"""Speculative decoding on the device: which sampled rows verify drafts, and which of
their tokens are kept.

The Rust core plans a verification row as one sequence row holding its last committed
token and ``d`` drafted tokens, and ``d + 1`` sampled rows on the same seat at
consecutive logits indices (``rust/sched/scheduler/speculation.rs``). From the step's own
arrays, :func:`draft_rows` finds each sampled row's offset in its group and the draft its
sample is compared with (the next input token, or -1 for a group's last row); the
sampler draws every row as it would without speculation, at the seat's token index plus
the offset (so a seeded request draws the same keys); :func:`kept_rows` says which rows
the core keeps: a row is kept while every earlier row of its group sampled its draft.
Only kept rows are recorded in the sampling table (token counts, the next token index).

Keeping a deterministic draft exactly when the target model samples it accepts it with
probability ``p(draft)``, and a rejected position keeps the model's own sample, drawn
from ``p`` given it is not the draft: the rejection-sampling rule for a point-mass draft,
so outputs follow the target distribution exactly (and greedy ones are identical).

Invariant: rows without drafts (every step without speculation) have offset 0 and draft
-1, and every valid one is kept: the step behaves as before.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def draft_rows(
    token_ids: jax.Array, logits_indices: jax.Array, sample_rows: jax.Array,
    num_sampled: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """``(offsets, drafts)``, int32 ``[S]`` each, of the step's sampled rows: row ``j``
    continues into row ``j + 1`` when both are valid, on the same seat, at consecutive
    logits indices; its draft is then the input token at ``logits_indices[j] + 1``."""
    s = logits_indices.shape[0]
    index = jnp.arange(s, dtype=jnp.int32)
    following = jnp.roll(logits_indices, -1)
    continues = (
        (index + 1 < num_sampled)
        & (jnp.roll(sample_rows, -1) == sample_rows)
        & (following == logits_indices + 1)
    )
    at = jnp.clip(logits_indices + 1, 0, token_ids.shape[0] - 1)
    drafts = jnp.where(continues, token_ids[at], -1).astype(jnp.int32)
    starts = jnp.concatenate([jnp.ones((1,), jnp.bool_), ~continues[:-1]])
    first = jax.lax.cummax(jnp.where(starts, index, 0))
    return index - first, drafts


def kept_rows(offsets: jax.Array, drafts: jax.Array, sampled: jax.Array) -> jax.Array:
    """bool ``[S]``: row ``j`` is kept when no earlier row of its group sampled other
    than its draft."""
    index = jnp.arange(offsets.shape[0], dtype=jnp.int32)
    rejected = ((drafts >= 0) & (sampled != drafts)).astype(jnp.int32)
    before = jnp.cumsum(rejected) - rejected  # rejections in rows 0 .. j - 1
    return before - before[index - offsets] == 0
