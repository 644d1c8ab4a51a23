"""The host decode-attention kernel (Rust, called by XLA as an FFI custom call): the
contract, its use on CPU, its absence from GPU programs, and bad plans as errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kvpage.kernels.host import cpu_decode_attention
from kvpage.kernels.xla.xla_paged_attention import xla_paged_attention
from test_pallas_kernels import assert_close, make_case, naive_attention

TOL = {"rtol": 1e-4, "atol": 1e-4}

pytestmark = pytest.mark.skipif(
    not cpu_decode_attention.available(), reason="kvpage._core without the host kernel"
)


def _attention(host_kernel: bool, decode_only: bool = False):
    def run(*args: jax.Array) -> jax.Array:
        return xla_paged_attention(
            *args, sm_scale=0.2, decode_only=decode_only, host_decode_kernel=host_kernel
        )

    return jax.jit(run)


@pytest.mark.parametrize(
    "q_lens,kv_lens",
    [
        ([1, 1, 1, 1], [1, 16, 17, 300]),  # decode only, block boundaries
        ([1, 5, 1, 1], [40, 9, 2, 129]),  # decodes mixed with a prefill chunk
        # past HOST_KERNEL_MAX_TOKENS: decode rows on the kernel, the chunk in lax loops
        ([1, 300, 1], [40, 310, 17]),
        # a large step: short prompts' tokens on the kernel, only the long row in loops
        ([1, 40, 300, 5, 2], [40, 90, 310, 5, 33]),
    ],
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float16, jnp.bfloat16])
@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # garbage slots -> inf
def test_matches_naive_attention_and_the_lax_loop(
    q_lens: list[int], kv_lens: list[int], dtype: jnp.dtype
) -> None:
    case = make_case(
        len(q_lens), q_lens, kv_lens, num_kv_heads=3, group=3, head_dim=64,
        block_size=16, pad_rows=2, pad_tokens=3, dtype=dtype,
    )  # fmt: skip
    decode_only = all(n == 1 for n in q_lens)
    with_kernel = _attention(True, decode_only)
    assert "kvpage_paged_decode_attention" in with_kernel.lower(*case.args).as_text()
    out = with_kernel(*case.args)
    tol = TOL if dtype == jnp.float32 else {"rtol": 2e-2, "atol": 2e-2}
    assert_close(out, naive_attention(case, 0.2), tol)
    lax_loop = _attention(False, decode_only)(*case.args)
    assert_close(out, lax_loop, tol)


@pytest.mark.parametrize("options", [{}, {"sliding_window": 5, "logit_soft_cap": 3.0}])
@pytest.mark.parametrize("q_lens,kv_lens", [([1, 1], [20, 33]), ([1, 300, 3], [20, 310, 9])])
def test_gpu_lowering_does_not_call_the_host_kernel(
    options: dict, q_lens: list[int], kv_lens: list[int]
) -> None:
    case = make_case(0, q_lens, kv_lens, num_kv_heads=2, group=2, head_dim=16, block_size=8)
    decode_only = all(n == 1 for n in q_lens)
    traced = jax.jit(
        lambda *a: xla_paged_attention(*a, sm_scale=0.25, decode_only=decode_only, **options)
    ).trace(*case.args)
    cuda = traced.lower(lowering_platforms=("cuda",)).as_text()
    assert "kvpage_paged_decode_attention" not in cuda
    assert "kvpage_paged_decode_attention" in traced.lower().as_text()


def test_a_page_outside_the_pool_is_an_error_not_a_read() -> None:
    case = make_case(1, [1, 1], [20, 33], num_kv_heads=2, group=2, head_dim=16, block_size=8)
    tables = np.asarray(case.block_tables).copy()
    tables[1, 0] = case.k_pages.shape[1] + 1000
    case.block_tables = jnp.asarray(tables)
    with pytest.raises(Exception, match="page id"):
        _attention(True, True)(*case.args).block_until_ready()


def test_a_bad_page_outside_the_window_is_never_read() -> None:
    """Out-of-window table entries are not even validated: the scheduler may free
    those blocks. The same bad id inside the window is still an error."""
    case = make_case(1, [1, 1], [20, 33], num_kv_heads=2, group=2, head_dim=16, block_size=8)
    tables = np.asarray(case.block_tables).copy()
    tables[1, 0] = case.k_pages.shape[1] + 1000  # row 1 (kv_len 33), window 9: blocks 3, 4
    run = jax.jit(
        lambda *a: xla_paged_attention(*a, sm_scale=0.2, decode_only=True, sliding_window=9)
    )
    out = run(*case.args[:4], jnp.asarray(tables), *case.args[5:])
    np.testing.assert_array_equal(np.asarray(out), np.asarray(run(*case.args)))
    with pytest.raises(Exception, match="page id"):
        tables[1, 3] = tables[1, 0]
        run(*case.args[:4], jnp.asarray(tables), *case.args[5:]).block_until_ready()
