"""The Pallas grouped matmul (MoE experts) against ``jax.lax.ragged_dot``.

On CPU the kernel runs with the Pallas interpreter; on a GPU machine the same tests run
the compiled Triton kernel. Shapes are shared across cases so one trace serves many
``group_sizes`` patterns (they are device values, not static). Padding rows of ``x``
hold NaN, so a padding row that is read into a product shows up.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kvpage.kernels.dispatch import compiled_kernels
from kvpage.kernels.pallas._compat import on_gpu
from kvpage.kernels.pallas.grouped_matmul import (
    _resolve,
    build_work_items,
    default_block_m,
    default_tiles,
    grouped_int8_matmul,
    grouped_matmul,
    max_work_items,
)

M, K, N, E = 40, 64, 48, 4  # N = 48: block_n 16; ceil(40 / 16) + 4 = 7 work items
PATTERNS = {
    "uneven": [5, 11, 17, 7],
    "empty-groups": [0, 23, 0, 17],
    "one-group-all": [0, 0, 40, 0],
    "padding-past-total": [3, 0, 9, 2],  # 26 padding rows
    "all-padding": [0, 0, 0, 0],
    "tile-aligned": [16, 0, 16, 8],
    "boundaries-in-one-tile": [1, 2, 3, 30],
}
TOL = {jnp.float32: {"rtol": 1e-5, "atol": 1e-5}, jnp.bfloat16: {"rtol": 2e-2, "atol": 2e-2}}


def _inputs(dtype, seed: int = 0, *, m: int = M, k: int = K, n: int = N, e: int = E):
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.standard_normal((m, k)) * 0.3, dtype)
    w = jnp.asarray(rng.standard_normal((e, n, k)) * 0.3, dtype)
    return x, w


def _nan_padding(x: jax.Array, sizes: list[int]) -> jax.Array:
    """``x`` with NaN in the padding rows (past ``sum(sizes)``), which must never be used."""
    return x.at[sum(sizes) :].set(jnp.nan)


def _reference(x, w, group_sizes, out_dtype=None):
    y = jax.lax.ragged_dot(
        jnp.nan_to_num(x), w.transpose(0, 2, 1), group_sizes,
        precision=jax.lax.Precision.HIGHEST, preferred_element_type=out_dtype,
    )  # fmt: skip
    return np.asarray(y.astype(jnp.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_matches_ragged_dot(pattern: str, dtype) -> None:
    sizes = PATTERNS[pattern]
    x, w = _inputs(dtype)
    x = _nan_padding(x, sizes)
    g = jnp.asarray(sizes, jnp.int32)
    got = grouped_matmul(x, w, g)
    assert got.shape == (M, N) and got.dtype == dtype
    got = np.asarray(got.astype(jnp.float32))
    np.testing.assert_allclose(got, _reference(x, w, g), **TOL[dtype])
    assert not np.any(got[sum(sizes) :]), "padding rows must be zeros"


def test_bf16_with_float32_output() -> None:
    sizes = PATTERNS["uneven"]
    x, w = _inputs(jnp.bfloat16, seed=1)
    g = jnp.asarray(sizes, jnp.int32)
    got = grouped_matmul(x, w, g, preferred_element_type=jnp.float32)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(
        np.asarray(got), _reference(x, w, g, jnp.float32), rtol=1e-5, atol=1e-5
    )


def test_group_sizes_are_traced_values() -> None:
    """One jitted function serves any group sizes (their values are unknown at trace)."""
    x, w = _inputs(jnp.float32, seed=2)
    f = jax.jit(grouped_matmul)
    for sizes in (PATTERNS["uneven"], PATTERNS["one-group-all"]):
        g = jnp.asarray(sizes, jnp.int32)
        np.testing.assert_allclose(np.asarray(f(x, w, g)), _reference(x, w, g), **TOL[jnp.float32])


def test_odd_widths_and_explicit_tiles() -> None:
    """N and K with no power-of-two divisor >= 16 (zero-padded), rows > one 32-row tile."""
    sizes = [9, 0, 30, 14, 6]
    x, w = _inputs(jnp.float32, seed=3, m=70, k=40, n=24, e=5)
    x = _nan_padding(x, sizes)
    g = jnp.asarray(sizes, jnp.int32)
    got = grouped_matmul(x, w, g, block_m=32, block_n=16)
    assert got.shape == (70, 24)
    np.testing.assert_allclose(np.asarray(got), _reference(x, w, g), **TOL[jnp.float32])


def test_group_sizes_past_the_rows_are_clipped() -> None:
    x, w = _inputs(jnp.float32, seed=4)
    g = jnp.asarray([30, 0, 25, 5], jnp.int32)  # sum 60 > M = 40
    got = np.asarray(grouped_matmul(x, w, g))
    want = np.einsum("mk,mnk->mn", np.asarray(x), np.asarray(w)[[0] * 30 + [2] * 10])
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_int8_weights(dtype) -> None:
    sizes = PATTERNS["padding-past-total"]
    rng = np.random.default_rng(5)
    x, _ = _inputs(dtype, seed=5)
    q = jnp.asarray(rng.integers(-127, 128, (E, N, K)), jnp.int8)
    scale = jnp.asarray(rng.uniform(0.001, 0.01, (E, N)), jnp.float32)
    g = jnp.asarray(sizes, jnp.int32)
    got = grouped_int8_matmul(x, q, scale, g, preferred_element_type=jnp.float32)
    w = (q.astype(jnp.float32) * scale[:, :, None]).astype(dtype)
    tol = 1e-4 if dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(
        np.asarray(got), _reference(x, w, g, jnp.float32), rtol=tol, atol=tol
    )
    assert not np.any(np.asarray(got)[sum(sizes) :])


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_work_items_cover_every_row_once(pattern: str) -> None:
    sizes = PATTERNS[pattern]
    block_m = 16
    num_items = max_work_items(M, E, block_m)
    items = np.asarray(build_work_items(jnp.asarray(sizes, jnp.int32), M, block_m=block_m,
                                        num_items=num_items))  # fmt: skip
    owner = np.full(M, -1)
    for group, tile, lo, hi in items.T:
        rows = [r for r in range(tile * block_m, (tile + 1) * block_m) if lo <= r < hi]
        assert all(owner[r] == -1 for r in rows), "a row is stored by two items"
        owner[rows] = group
    want = np.repeat(np.arange(E + 1), sizes + [M - sum(sizes)])
    np.testing.assert_array_equal(owner, want)  # padding rows belong to pseudo-group E


def test_default_tiles_and_bad_arguments() -> None:
    assert default_block_m(8, 64) == 16 and default_block_m(1024, 32) == 32
    assert default_block_m(4096, 8) == 128 and default_block_m(4096, 8, itemsize=4) == 64
    assert default_tiles(4096, 8, 14336, 2) == (128, 128, 8)
    assert default_tiles(64, 128, 768, 2) == (16, 64, 4)
    assert default_tiles(4096, 8, 48, 2) == (128, 16, 4)  # N = 48: a 16-wide out tile
    x, w = _inputs(jnp.float32)
    g = jnp.asarray(PATTERNS["uneven"], jnp.int32)
    with pytest.raises(ValueError, match="K"):
        grouped_matmul(x[:, :32], w, g)
    with pytest.raises(ValueError, match="group_sizes"):
        grouped_matmul(x, w, g[:3])
    with pytest.raises(ValueError, match="powers of two"):
        grouped_matmul(x, w, g, block_m=24)
    with pytest.raises(ValueError, match="int8"):
        grouped_int8_matmul(x, w, jnp.ones((E, N)), g)


def test_interpret_default_follows_compiled_kernels() -> None:
    assert _resolve(None) is (not on_gpu())
    with compiled_kernels():
        assert _resolve(None) is False
    assert _resolve(True) is True and _resolve(False) is False
