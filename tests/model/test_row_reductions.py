"""``first_max_index`` is ``jnp.argmax`` over the last axis, element for element: first
maximum on ties, first NaN where a row has one, 0 for an all ``-inf`` row, on both of its
paths (two passes for arrays up to ``FIRST_MAX_TWO_PASS_ELEMENTS``, argmax above).
``mean_of_squares`` (RMSNorm's statistic) gives a row the same bits alone and among
other rows, inside a fused norm, and equals the mean to float32 rounding."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvpage.model import row_reductions
from kvpage.model.row_reductions import first_max_index, mean_of_squares, tree_row_sums

SPECIAL = [np.nan, np.inf, -np.inf, 0.0, -0.0, 1.0, 1.0]


@st.composite
def logits(draw: st.DrawFn) -> np.ndarray:
    rows, cols = draw(st.integers(1, 6)), draw(st.integers(1, 70))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    x = rng.integers(-3, 4, (rows, cols)).astype(np.float32)  # many ties
    special = rng.random((rows, cols)) < draw(st.sampled_from([0.0, 0.05, 0.3]))
    x[special] = rng.choice(SPECIAL, int(special.sum()))
    if draw(st.booleans()):
        x[0] = -np.inf
    return x


@settings(max_examples=60, deadline=None)
@given(logits())
def test_first_max_index_is_argmax(x: np.ndarray) -> None:
    want = np.asarray(jnp.argmax(x, axis=-1))
    got = np.asarray(jax.jit(first_max_index)(jnp.asarray(x)))
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("limit", [0, 1 << 22])
def test_both_paths_agree_on_a_large_vocabulary(limit: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(row_reductions, "FIRST_MAX_TWO_PASS_ELEMENTS", limit)
    x = np.random.default_rng(3).normal(size=(4, 49152)).astype(np.float32)
    x[1, 7] = x[1, 40000] = 9.0  # a tie: the first wins
    x[2, 123] = np.nan
    want = np.asarray(jnp.argmax(x, axis=-1))
    np.testing.assert_array_equal(np.asarray(first_max_index(jnp.asarray(x))), want)
    assert want[1] == 7 and want[2] == 123


@pytest.mark.parametrize("features", [64, 896, 1000])
def test_a_norm_of_a_row_does_not_depend_on_the_other_rows(features: int) -> None:
    # jnp.mean over 896 features gave 4 of the first 16 rows other bits among 4-17 rows.
    rng = np.random.default_rng(features)
    x = jnp.asarray(rng.normal(size=(256, features)).astype(np.float32) * 3)
    residual = jnp.asarray(rng.normal(size=(256, features)).astype(np.float32))
    weight = jnp.asarray(rng.normal(size=(features,)).astype(np.float32))

    @jax.jit
    def norm(x: jax.Array, r: jax.Array) -> jax.Array:  # fused as in a decoder layer
        h = x + r
        return weight * (h * jax.lax.rsqrt(mean_of_squares(h) + 1e-6))

    alone = np.stack([np.asarray(norm(x[i:i + 1], residual[i:i + 1]))[0] for i in range(16)])
    for rows in (2, 3, 4, 8, 16, 17, 32, 256):
        together = np.asarray(norm(x[:rows], residual[:rows]))[:16]
        np.testing.assert_array_equal(together, alone[:rows])


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 5), st.integers(1, 300), st.integers(0, 2**31 - 1))
def test_tree_row_sums_are_the_sums(rows: int, cols: int, seed: int) -> None:
    x = np.random.default_rng(seed).normal(size=(rows, cols)).astype(np.float32)
    got = np.asarray(tree_row_sums(jnp.asarray(x)))
    assert got.shape == (rows, 1)
    np.testing.assert_allclose(got[:, 0], x.astype(np.float64).sum(-1), rtol=1e-5, atol=1e-4)
