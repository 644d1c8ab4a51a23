"""``first_max_index`` is ``jnp.argmax`` over the last axis, element for element: first
maximum on ties, first NaN where a row has one, 0 for an all ``-inf`` row, on both of its
paths (two passes for arrays up to ``FIRST_MAX_TWO_PASS_ELEMENTS``, argmax above)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvpage.model import row_reductions
from kvpage.model.row_reductions import first_max_index

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
