"""Linear layers with quantized weights on the host CPU, as XLA FFI custom calls.

Owns :func:`cpu_qmatmul_nt`: ``x [T, K] . dequant(w) [N, K]^T`` read straight from the
weight's stored blocks by the Rust core (``rust/kernels/quant``, exported by
``rust/kernels/xla_ffi_quant.rs`` as ``kvpage_qmatmul_<kind>``). The inputs are quantized
to 8 bits per block of 32 inside the call, as llama.cpp does, so the product is integer
multiply-adds over the packed weights; every row count goes here (decode and prefill),
so a sequence sees the same arithmetic in both.

Only the ``cpu`` platform has the targets: :func:`cpu_qmatmul_nt` takes the function to
lower on any other platform (``lax.platform_dependent``), so one traced program still
lowers for GPUs. The call has no derivative. ``KVPAGE_CPU_MATMUL_PORTABLE=1`` (read by
the core) makes it use the portable loop instead of AVX2.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._host_ffi import core_library, register

KINDS = ("q8_0", "q4_0", "q4_1", "q4_k", "q6_k", "int8")


def target(kind: str) -> str:
    return f"kvpage_qmatmul_{kind}"


def available(kind: str) -> bool:
    """Whether the core exports (and JAX now has registered) ``kind``'s kernel."""
    return kind in KINDS and register(target(kind))


@functools.cache
def vectorized() -> bool:
    """Whether the core runs these products with AVX2 here (else its portable loop)."""
    probe = getattr(core_library(), "kvpage_qmatmul_vectorized", None)
    return bool(probe()) if probe is not None else False


def cpu_qmatmul_nt(
    x: jax.Array,
    blocks: jax.Array,
    row_scales: jax.Array | None,
    kind: str,
    *,
    otherwise: Callable[[], jax.Array],
) -> jax.Array:
    """float32 ``x [T, K] . dequant(w)^T`` ``[T, N]`` for the stored ``blocks [N, bytes]``
    (``row_scales [N]`` for int8) of format ``kind``: the Rust kernel when lowered for
    CPU, ``otherwise()`` (the same product) everywhere else."""
    if x.ndim != 2 or blocks.ndim != 2 or not available(kind):
        return otherwise()
    call = jax.ffi.ffi_call(
        target(kind), jax.ShapeDtypeStruct((x.shape[0], blocks.shape[0]), jnp.float32)
    )
    args = (x.astype(jnp.float32), blocks) + (() if row_scales is None else (row_scales,))
    return lax.platform_dependent(cpu=lambda: call(*args), default=otherwise)
