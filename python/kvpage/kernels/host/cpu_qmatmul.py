"""Linear layers with quantized weights on the host CPU, as XLA FFI custom calls.

Owns :func:`qmatmul_call` and :func:`dequantize_call` (the Rust core's
``rust/kernels/quant``, exported by ``rust/kernels/xla_ffi_quant.rs``) and the row count
where one hands over to the other (:data:`DEQUANTIZE_ROWS`):

* ``kvpage_qmatmul_<kind>``: ``x [T, K] . dequant(w) [N, K]^T`` read straight from the
  stored blocks (one row: 16-bit inputs and integer multiply-adds; more rows: each
  sub-block expanded to float once in registers and shared by the rows). Only the
  first ``live_rows`` rows (a device scalar) are computed, the others are zeros: a
  padded step's padding rows cost nothing.
* ``kvpage_dequantize_<kind>``: the float weight ``[N, K]``, which XLA's GEMM then
  multiplies: for prefill-sized products, where that GEMM beats the kernel's register
  blocking. 30 chained SmolLM2 layers' matmuls (7 weights, cache-resident), Q4_1 kernel
  vs XLA float32 on the 2-core AVX2 EPYC: 35 / 45 ms at T = 16, 72 / 68 ms at T = 32,
  574 / 341 ms at T = 256. In a real step the expansion writes every weight as float32
  (540 MB for SmolLM2), which a decode step pays each time: 64 requests x 64 tokens
  (64-row decode steps) ran at 134 tok/s dequantizing from 64 rows, 188 tok/s from 128
  (float32 weights: 206). So products of 128 rows or more (prefill chunks, big decode
  batches) dequantize.

Only the ``cpu`` platform has the targets; callers put these calls in the ``cpu`` branch
of ``lax.platform_dependent`` (``kvpage/model/linear_kernels.py``), so one traced program
still lowers for GPUs. The calls have no derivative. ``KVPAGE_CPU_MATMUL_PORTABLE=1``
(read by the core) makes them use the portable loops instead of AVX2.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from kvpage.kernels.host._host_ffi import core_library, register
from kvpage.quant import formats

# Every format, in the order of Rust's QuantType::ALL (the table: kvpage.quant.formats).
KINDS: tuple[str, ...] = formats.KINDS
DEQUANTIZE_ROWS = 128


def target(kind: str) -> str:
    return f"kvpage_qmatmul_{kind}"


def available(kind: str) -> bool:
    """Whether the core exports (and JAX now has registered) ``kind``'s kernels."""
    return kind in KINDS and register(target(kind)) and register(f"kvpage_dequantize_{kind}")


def qmatmul_call(
    x: jax.Array,
    blocks: jax.Array,
    row_scales: jax.Array | None,
    kind: str,
    live_rows: jax.Array | int | None = None,
    invariant: bool = False,
) -> jax.Array:
    """float32 ``x [T, K] . dequant(w)^T`` by the core (lower for ``cpu`` only); with
    ``live_rows`` (an int32 scalar, ``0 <= live_rows <= T``) only ``x``'s first rows are
    multiplied and the result's other rows are zeros. ``invariant``: every row on the
    float path, so a row's result does not depend on the other rows (batch-invariant
    inference; ``kvpage_qmatmul_invariant_<kind>``)."""
    rows = x.shape[0]
    live = jnp.asarray(rows if live_rows is None else live_rows, jnp.int32).reshape(1)
    name = f"kvpage_qmatmul_invariant_{kind}" if invariant else target(kind)
    if invariant and not register(name):
        raise RuntimeError(f"this kvpage core has no {name} (rebuild it)")
    call = jax.ffi.ffi_call(name, jax.ShapeDtypeStruct((rows, blocks.shape[0]), jnp.float32))
    scales = () if row_scales is None else (row_scales,)
    return call(x.astype(jnp.float32), blocks, *scales, live)


def dequantize_call(
    blocks: jax.Array, row_scales: jax.Array | None, kind: str, inner: int
) -> jax.Array:
    """The float32 weight ``[N, inner]`` of stored ``blocks`` (lower for ``cpu`` only)."""
    call = jax.ffi.ffi_call(
        f"kvpage_dequantize_{kind}", jax.ShapeDtypeStruct((blocks.shape[0], inner), jnp.float32)
    )
    return call(blocks, *(() if row_scales is None else (row_scales,)))


@functools.cache
def vectorized() -> bool:
    """Whether the core runs these products with AVX2 here (else its portable loop)."""
    probe = getattr(core_library(), "kvpage_qmatmul_vectorized", None)
    return bool(probe()) if probe is not None else False
