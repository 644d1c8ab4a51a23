"""Weight-only int8 matmul for GPUs as a Pallas (Triton) kernel: ``x . (q * s)^T``.

Owns :func:`int8_matmul_nt`: ``x [M, K]`` (bfloat16 or float32) times a per-channel
int8 weight ``q [N, K]`` with float32 scales ``s [N]`` (kvpage's ``int8`` format,
``kvpage/quant/int8.py``). Each program owns a ``block_m x block_n`` output tile and
walks K in ``block_k`` steps: it loads a ``block_n x block_k`` int8 tile (a quarter of
the bytes of float32, half of bfloat16), converts it to ``x``'s dtype in registers, and
accumulates ``tl.dot`` products in float32; the scale multiplies the finished tile once.
The float weight never exists in memory.

Rows are padded to ``block_m`` (16, the smallest ``tl.dot`` tile) and outputs to
``block_n``; ``K`` must be a multiple of ``block_k``, which is chosen as the largest
power of two up to 128 dividing ``K`` (at least 16). ``interpret=None`` compiles on a
GPU and runs the Pallas interpreter elsewhere (tests); the Triton build for sm_90a is
checked on a CPU machine (``tests/kernels/test_gpu_build.py``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from kvpage.kernels.pallas._compat import on_gpu, triton_compiler_params


def _block_k(inner: int) -> int:
    for size in (128, 64, 32, 16):
        if inner % size == 0:
            return size
    raise ValueError(f"int8_matmul_nt needs K a multiple of 16, got {inner}")


def _kernel(x_ref, q_ref, s_ref, o_ref, *, block_m: int, block_n: int, block_k: int,
            steps: int) -> None:
    i, j = pl.program_id(0), pl.program_id(1)
    rows, outs = pl.ds(i * block_m, block_m), pl.ds(j * block_n, block_n)

    def step(k: jax.Array, acc: jax.Array) -> jax.Array:
        cols = pl.ds(k * block_k, block_k)
        x = x_ref[rows, cols]
        w = q_ref[outs, cols].astype(x.dtype)
        return acc + lax.dot_general(
            x, w, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32
        )

    acc = lax.fori_loop(0, steps, step, jnp.zeros((block_m, block_n), jnp.float32))
    o_ref[rows, outs] = (acc * s_ref[outs][None, :]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("block_m", "block_n", "num_warps", "interpret"))
def int8_matmul_nt(
    x: jax.Array,
    q: jax.Array,
    scale: jax.Array,
    *,
    block_m: int = 16,
    block_n: int = 64,
    num_warps: int = 4,
    interpret: bool | None = None,
) -> jax.Array:
    """``x [M, K] . (q [N, K] * scale [N, None])^T`` as ``[M, N]`` in ``x``'s dtype."""
    m, k = x.shape
    n = q.shape[0]
    if q.shape != (n, k) or q.dtype != jnp.int8 or scale.shape != (n,):
        raise ValueError(f"expected q int8 [{n}, {k}] and scale [{n}], got {q.dtype} "
                         f"{q.shape} and {scale.shape}")
    block_k = _block_k(k)
    m_pad, n_pad = -(-m // block_m) * block_m, -(-n // block_n) * block_n
    xp = jnp.pad(x, ((0, m_pad - m), (0, 0)))
    qp = jnp.pad(q, ((0, n_pad - n), (0, 0)))
    sp = jnp.pad(scale.astype(jnp.float32), (0, n_pad - n))
    kernel = functools.partial(_kernel, block_m=block_m, block_n=block_n, block_k=block_k,
                               steps=k // block_k)

    def whole(shape: tuple[int, ...]) -> pl.BlockSpec:
        origin = (0,) * len(shape)
        return pl.BlockSpec(shape, lambda i, j: origin)

    out = pl.pallas_call(
        kernel,
        grid=(m_pad // block_m, n_pad // block_n),
        in_specs=[whole(xp.shape), whole(qp.shape), whole(sp.shape)],
        out_specs=whole((m_pad, n_pad)),
        out_shape=jax.ShapeDtypeStruct((m_pad, n_pad), x.dtype),
        interpret=(not on_gpu()) if interpret is None else interpret,
        compiler_params=triton_compiler_params(num_warps, 3),
        name=f"int8_matmul_m{block_m}_n{block_n}_k{block_k}",
    )(xp, qp, sp)
    return out[:m, :n]
