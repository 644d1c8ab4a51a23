"""The two-level inverse-CDF draw (kvpage.sampling.categorical): it follows
softmax(logits), never draws a masked token, and each row depends on its own key only."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import numpy as np
import pytest
from kvpage.sampling.categorical import CHUNK, draw_categorical


def draws(logits: np.ndarray, n: int, seed: int = 0) -> np.ndarray:
    """``n`` draws of one row (as ``n`` rows with independent keys)."""
    keys = jax.random.split(jax.random.key(seed), n)
    rows = jnp.broadcast_to(jnp.asarray(logits, jnp.float32), (n, logits.shape[-1]))
    return np.asarray(jax.jit(draw_categorical)(rows, keys))


@pytest.mark.parametrize("vocab", [7, CHUNK, CHUNK * 3 + 5])
def test_frequencies_follow_softmax(vocab: int) -> None:
    rng = np.random.default_rng(vocab)
    logits = rng.normal(size=vocab).astype(np.float32) * 2
    logits[rng.choice(vocab, size=max(1, vocab // 3), replace=False)] = -np.inf
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    n = 40_000
    counts = np.bincount(draws(logits, n), minlength=vocab)
    assert counts[probs == 0].sum() == 0
    expected = probs * n
    big = expected > 50  # chi-square over the well-populated tokens, the rest pooled
    observed = np.append(counts[big], counts[~big].sum())
    wanted = np.append(expected[big], expected[~big].sum())
    keep = wanted > 0
    chi2 = (((observed - wanted) ** 2)[keep] / wanted[keep]).sum()
    dof = keep.sum() - 1
    assert chi2 < dof + 6 * np.sqrt(2 * dof) + 10, (chi2, dof)


def test_masked_tokens_are_never_drawn_even_at_the_edges() -> None:
    vocab = CHUNK * 2 + 3
    logits = np.full(vocab, -np.inf, np.float32)
    logits[[0, CHUNK - 1, CHUNK, vocab - 1]] = [0.0, 30.0, -30.0, 5.0]
    got = set(draws(logits, 5000).tolist())
    assert got <= {0, CHUNK - 1, CHUNK, vocab - 1} and CHUNK - 1 in got
    one = np.full(vocab, -np.inf, np.float32)
    one[vocab - 2] = 1.0
    assert set(draws(one, 200).tolist()) == {vocab - 2}


def test_rows_are_independent_of_each_other() -> None:
    rng = np.random.default_rng(1)
    logits = jnp.asarray(rng.normal(size=(6, 1000)), jnp.float32)
    keys = jax.random.split(jax.random.key(3), 6)
    full = np.asarray(draw_categorical(logits, keys))
    for r in range(6):
        assert draw_categorical(logits[r : r + 1], keys[r : r + 1])[0] == full[r]
