"""The device side of speculative decoding (:mod:`kvpage.sampling.verification`): kept
tokens follow the target distribution.

Thousands of two-row verification groups in one call: row 0 samples the position after
the committed token from ``p0``, row 1 the next position from ``p1`` given the draft
``d``. Row 1 must be kept exactly when row 0 drew ``d``; the kept first tokens must follow
``p0`` and the kept second tokens ``p1`` (chi-square, fixed keys: no flake)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from kvpage.sampling.sampler import SamplingInputs, sample
from kvpage.sampling.verification import draft_rows, kept_rows
from scipy import stats

GROUPS, V, DRAFT = 6000, 6, 2
P0 = np.asarray([0.10, 0.15, 0.40, 0.05, 0.20, 0.10])  # the draft (2) is likely
P1 = np.asarray([0.30, 0.05, 0.05, 0.25, 0.15, 0.20])


def _inputs(n: int) -> SamplingInputs:
    return SamplingInputs(
        temperature=jnp.ones(n), top_k=jnp.zeros(n, jnp.int32), top_p=jnp.ones(n),
        min_p=jnp.zeros(n), presence_penalty=jnp.zeros(n), frequency_penalty=jnp.zeros(n),
        repetition_penalty=jnp.ones(n), seed=jnp.zeros((n, 2), jnp.uint32),
        has_seed=jnp.zeros(n, bool), step=jnp.zeros(n, jnp.int32), output_counts=None,
        prompt_mask=None,
    )


def test_kept_tokens_follow_the_target_distribution() -> None:
    n = 2 * GROUPS
    # Group g: logits indices 2g, 2g + 1 (row 1's input token is the draft); adjacent
    # groups sit on different seats, so they never chain.
    token_ids = np.zeros(n, np.int32)
    token_ids[1::2] = DRAFT
    seats = (np.arange(n) // 2 % 2).astype(np.int32)
    offsets, drafts = draft_rows(token_ids, np.arange(n, dtype=np.int32), seats, np.int32(n))
    assert list(np.asarray(offsets[:4])) == [0, 1, 0, 1]
    assert list(np.asarray(drafts[:4])) == [DRAFT, -1, DRAFT, -1]
    logits = np.log(np.where(np.arange(n)[:, None] % 2 == 0, P0, P1)).astype(np.float32)
    out = jax.jit(lambda x: sample(x, _inputs(n), jax.random.key(7), 0))(logits)
    tokens = np.asarray(out.token_ids)
    kept = np.asarray(kept_rows(offsets, drafts, out.token_ids))
    first, second = tokens[0::2], tokens[1::2]
    assert kept[0::2].all()
    assert (kept[1::2] == (first == DRAFT)).all()
    for drawn, p in ((first, P0), (second[first == DRAFT], P1)):
        counts = np.bincount(drawn, minlength=V)
        assert stats.chisquare(counts, p * counts.sum()).pvalue > 1e-3
