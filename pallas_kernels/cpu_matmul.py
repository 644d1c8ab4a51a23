"""Linear layers of few rows on the host CPU, as an XLA FFI custom call into kvpage's core.

Owns :func:`cpu_matmul_nt` and the row range it serves. A decode step is a chain of
``[T, in] x [out, in]^T`` products with a handful of rows; XLA:CPU's dot runs 2..16
rows at about half the memory bandwidth of its one-row GEMV, so a 4-row step of a small
model cost twice a 1-row step. The Rust kernel (``rust/kernels/cpu_matmul.rs``, exported by
``rust/kernels/xla_ffi.rs``) streams each weight row once against every input row, on XLA's
own intra-op thread pool.

Policy: ``MIN_ROWS <= T <= MAX_ROWS`` rows, float32 operands, ``cpu`` platform, a CPU
the core has a vectorized kernel for (AVX-512 today; elsewhere XLA's dot is faster than
the portable loop, which stays for tests: ``KVPAGE_CPU_MATMUL=1`` forces it). One
row stays with XLA (its GEMV is as fast), and so do prefill-sized products (its GEMM
is). Measured with 120 chained products of SmolLM2's MLP shape on the 2-core EPYC of
benches/RESULTS.md: XLA 14 / 29 / 34 / 40 / 47 / 73 ms at T = 1 / 2 / 4 / 8 / 16 / 32,
this kernel 17 / 19 / 21 / 24 / 34 / 62 ms.

Only the ``cpu`` platform has the target: :func:`cpu_matmul_nt` takes the function to
lower on any other platform (``lax.platform_dependent``), so one traced program still
lowers for GPUs. The call has no derivative: callers decide when it may be traced
(:mod:`kvpage.model.linear_kernels`). ``KVPAGE_CPU_MATMUL=0`` turns it off.
``KVPAGE_CPU_MATMUL_PORTABLE=1`` (read by the core) makes it use the portable loop.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._host_ffi import core_library, register

TARGET = "kvpage_matmul_nt"
MIN_ROWS = 2
MAX_ROWS = 32


def available() -> bool:
    """Whether the Rust kernel is registered for the ``cpu`` platform (registers it once)
    and worth routing to (see the policy in the module docs)."""
    setting = os.environ.get("KVPAGE_CPU_MATMUL", "auto")
    if setting == "0" or not register(TARGET):
        return False
    return setting == "1" or _vectorized()


def _vectorized() -> bool:
    library = core_library()
    probe = getattr(library, "kvpage_matmul_nt_vectorized", None)
    return probe is not None and bool(probe())


def serves(x: jax.Array, w: jax.Array) -> bool:
    """Whether ``x [T, K] . w [N, K]^T`` is in the kernel's range (policy in the module docs)."""
    return (
        x.ndim == 2
        and w.ndim == 2
        and x.shape[1] == w.shape[1]
        and MIN_ROWS <= x.shape[0] <= MAX_ROWS
        and x.dtype == jnp.float32
        and w.dtype == jnp.float32
        and available()
    )


def cpu_matmul_nt(x: jax.Array, w: jax.Array, *, otherwise: Callable[[], jax.Array]) -> jax.Array:
    """``x [T, K] . w [N, K]^T`` float32 ``[T, N]``: the Rust kernel when lowered for CPU
    and :func:`serves` says so, ``otherwise()`` (same product) everywhere else."""
    if not serves(x, w):
        return otherwise()
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct((x.shape[0], w.shape[0]), jnp.float32))
    return lax.platform_dependent(cpu=lambda: call(x, w), default=otherwise)
