"""Linear layers of few rows on the host CPU, as an XLA FFI custom call into kvpage's core.

Owns :func:`cpu_matmul_nt` and the row range it serves. A decode step is a chain of
``[T, in] x [out, in]^T`` products with a handful of rows; XLA:CPU's dot runs 2..16
rows at about half the memory bandwidth of its one-row GEMV, so a 4-row step of a small
model cost twice a 1-row step. The Rust kernel (``rust/kernels/cpu_matmul.rs``, exported by
``rust/kernels/xla_ffi.rs``) streams each weight row once against every input row, on XLA's
own intra-op thread pool.

Policy: ``MIN_ROWS <= T <= max_rows()`` rows, float32 operands, ``cpu`` platform, a CPU
the core has a vectorized kernel for (elsewhere XLA's dot is faster than the portable
loop, which stays for tests: ``KVPAGE_CPU_MATMUL=1`` forces it, up to ``MAX_ROWS``).
Prefill-sized products stay with XLA (its GEMM is faster). One row takes the kernel too:
it is as fast as XLA's GEMV (9.5-10.0 against 9.3-9.9 ms for the chain below,
2026-11-28), and a row then gets the same sums alone as among up to ``max_rows()`` rows,
so a speculative verification's rows equal the decode step's bit for bit (XLA's GEMV
and this kernel round differently). The upper bound follows the kernel's vector width
(:data:`MAX_ROWS_BY_LANES`), measured with 120 chained products of SmolLM2's MLP shape
on 2-core EPYCs
(``benches/cpu_matmul_chain.py``):

* AVX-512 (16 lanes): XLA 14 / 29 / 34 / 40 / 47 / 73 ms at T = 1 / 2 / 4 / 8 / 16 / 32,
  this kernel 17 / 19 / 21 / 24 / 34 / 62 ms: up to 32 rows (at T = 1 equal since:
  above).
* AVX2 + FMA (8 lanes, half the registers): XLA 26 / 28 / 35 ms at T = 2 / 4 / 8,
  this kernel 14 / 16 / 24 ms (quiet machine); at T = 16 / 32, with the machine busy,
  XLA 80 / 119 ms, this kernel 78 / 147 ms: up to 8 rows.

Only the ``cpu`` platform has the target: :func:`cpu_matmul_nt` takes the function to
lower on any other platform (``lax.platform_dependent``), so one traced program still
lowers for GPUs. The call has no derivative: callers decide when it may be traced
(:mod:`kvpage.model.linear_kernels`). ``KVPAGE_CPU_MATMUL=0`` turns it off.
``KVPAGE_CPU_MATMUL_PORTABLE=1`` (read by the core) makes it use the portable loop.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from kvpage.kernels.host._host_ffi import core_library, register

TARGET = "kvpage_matmul_nt"
MIN_ROWS = 1
MAX_ROWS = 32
# The kernel's f32 lanes (``kvpage_matmul_nt_lanes``) -> the most rows it beats XLA at.
MAX_ROWS_BY_LANES = {16: 32, 8: 8}


def available() -> bool:
    """Whether the Rust kernel is registered for the ``cpu`` platform (registers it once)
    and worth routing to (see the policy in the module docs)."""
    return max_rows() >= MIN_ROWS


def max_rows() -> int:
    """The most rows routed to the kernel here (0: none; policy in the module docs)."""
    setting = os.environ.get("KVPAGE_CPU_MATMUL", "auto")
    if setting == "0" or not register(TARGET):
        return 0
    if setting == "1":
        return MAX_ROWS
    return MAX_ROWS_BY_LANES.get(_lanes(), 0)


@functools.cache
def _lanes() -> int:
    """The vector width of the core's kernel on this CPU (0: the portable loop)."""
    probe = getattr(core_library(), "kvpage_matmul_nt_lanes", None)
    return int(probe()) if probe is not None else 0


def _fits(x: jax.Array, w: jax.Array) -> bool:
    """Whether ``x [T, K] . w [N, K]^T`` is a product the kernel computes (float32, 2-D)."""
    return (x.ndim == 2 and w.ndim == 2 and x.shape[1] == w.shape[1]
            and x.dtype == jnp.float32 and w.dtype == jnp.float32)


def serves(x: jax.Array, w: jax.Array) -> bool:
    """Whether ``x [T, K] . w [N, K]^T`` is in the kernel's range (policy in the module docs)."""
    return _fits(x, w) and MIN_ROWS <= x.shape[0] <= max_rows()


def cpu_matmul_nt(x: jax.Array, w: jax.Array, *, otherwise: Callable[[], jax.Array],
                  every_row_count: bool = False) -> jax.Array:
    """``x [T, K] . w [N, K]^T`` float32 ``[T, N]``: the Rust kernel when lowered for CPU
    and :func:`serves` says so, ``otherwise()`` (same product) everywhere else. With
    ``every_row_count`` the kernel takes any number of float32 rows (batch-invariant
    inference: a row's sum order depends only on ``K``)."""
    if not (serves(x, w) or every_row_count and _fits(x, w) and register(TARGET)):
        return otherwise()
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32))
    return lax.platform_dependent(cpu=lambda: call(x, w), default=otherwise)
