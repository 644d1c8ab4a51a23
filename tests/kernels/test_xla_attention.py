"""The live-length XLA attention backend: the contract, and scratch that ignores the
padded table width."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kvpage.kernels import paged_attention
from kvpage.kernels.xla.xla_paged_attention import xla_paged_attention
from test_pallas_kernels import Case, assert_close, make_case, naive_attention

TOL = {"rtol": 1e-4, "atol": 1e-4}

CASES = [
    # (q_lens, kv_lens): mixed prefill chunks with context, decodes, a 1-token chunk
    ([3, 1, 1, 200, 1], [11, 8, 300, 250, 1]),
    ([1, 40, 1, 2], [129, 300, 7, 2]),
    ([17], [17]),
    ([1, 1, 1], [5, 130, 64]),
]


@pytest.mark.parametrize("q_lens,kv_lens", CASES)
@pytest.mark.parametrize("q_tile,chunk,decode_chunk", [(128, 8, 2), (16, 2, 1), (7, 3, 5)])
def test_matches_naive_attention(
    q_lens: list[int], kv_lens: list[int], q_tile: int, chunk: int, decode_chunk: int
) -> None:
    case = make_case(
        sum(q_lens),
        q_lens,
        kv_lens,
        num_kv_heads=3,
        group=3,
        head_dim=32,
        block_size=16,
        pad_rows=2,
        pad_tokens=5,
    )
    out = xla_paged_attention(
        *case.args,
        sm_scale=0.125,
        decode_only=all(n == 1 for n in q_lens),
        q_tile=q_tile,
        kv_chunk_blocks=chunk,
        decode_chunk_blocks=decode_chunk,
    )
    assert_close(out, naive_attention(case, 0.125), TOL)


def test_dispatch_default_off_gpu_is_xla() -> None:
    case = make_case(3, [4, 1], [9, 20], num_kv_heads=2, group=2, head_dim=16, block_size=8)
    out = paged_attention(*case.args, sm_scale=0.25)
    assert_close(out, naive_attention(case, 0.25), TOL)


def _temp_bytes(fn: object, case: Case) -> int:
    compiled = jax.jit(fn).lower(*case.args).compile()  # type: ignore[arg-type]
    return int(compiled.memory_analysis().temp_size_in_bytes)


def _with_width(case: Case, width: int) -> Case:
    tables = np.asarray(case.block_tables)
    num_pages = case.k_pages.shape[1]
    wide = np.full((tables.shape[0], width), num_pages - 1, np.int32)
    wide[:, : tables.shape[1]] = tables
    case.block_tables = jnp.asarray(wide)
    return case


def test_scratch_does_not_follow_table_width() -> None:
    """A table 64x wider (max_model_len 64x larger) must not grow the step's scratch;
    the reference, which gathers the padded table per token, does grow."""

    def xla(*args: jax.Array) -> jax.Array:
        return xla_paged_attention(*args, sm_scale=0.1)

    def reference(*args: jax.Array) -> jax.Array:
        return paged_attention(*args, sm_scale=0.1, backend="reference")

    def case() -> Case:
        return make_case(
            5, [64, 1, 1], [64, 30, 40], num_kv_heads=2, group=2, head_dim=16, block_size=8
        )

    narrow, wide = _with_width(case(), 16), _with_width(case(), 1024)
    assert _temp_bytes(xla, wide) <= 1.1 * _temp_bytes(xla, narrow) + 4096
    assert _temp_bytes(reference, wide) > 16 * _temp_bytes(reference, narrow)
    assert_close(xla(*wide.args), naive_attention(wide, 0.1), TOL)
