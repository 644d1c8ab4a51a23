"""Linear layers with quantized weights on the host CPU, as XLA FFI custom calls.

Owns :func:`qmatmul_call` and :func:`dequantize_call` (the Rust core's
``rust/kernels/quant``, exported by ``rust/kernels/xla_ffi_quant.rs``) and the row count
where one hands over to the other (:func:`dequantize_rows`):

* ``kvpage_qmatmul_<kind>``: ``x [T, K] . dequant(w) [N, K]^T`` read straight from the
  stored blocks: the integer path (16-bit inputs, integer multiply-adds) up to 16 rows
  with AVX2, 32 with AVX-512 VNNI (:func:`integer_rows`), and with VNNI for any row
  count in blocks of 32 (:func:`integer_blocks`); otherwise each sub-block expanded to
  float once in registers and shared by the rows.
  Only the first ``live_rows`` rows (a device scalar) are computed, the others are
  zeros: a padded step's padding rows cost nothing.
* ``kvpage_qmatmul_multi_<kind>``: the same for up to :data:`MAX_MULTI_WEIGHTS` weights
  of one format that read the same ``x`` (a layer's q/k/v, or gate and up), in one call:
  ``x`` prepared once, one hand-over to the thread pool (:func:`qmatmul_multi_call`).
* ``kvpage_qmatmul_tiles_<kind>``, ``kvpage_qmatmul_multi_tiles_<kind>``,
  ``kvpage_dequantize_tiles_<kind>`` (Q4_0, Q4_1): the same on weights packed into tiles
  of sixteen rows (:mod:`kvpage.quant.tiles`).
* ``kvpage_dequantize_<kind>``: the float weight ``[N, K]``, which XLA's GEMM then
  multiplies: for prefill-sized products, where that GEMM beats the kernel. In a real
  step the expansion writes every weight as float32 (540 MB for SmolLM2), which a
  decode step pays each time.

Where the hand-over lies (:func:`dequantize_rows`):
* without the VNNI blocks: 128 rows. 30 chained SmolLM2 layers' matmuls (7 weights,
  cache-resident), Q4_1 kernel vs XLA float32 on a 2-core AVX2 EPYC: 35 / 45 ms at
  T = 16, 72 / 68 ms at T = 32, 574 / 341 ms at T = 256; 64 requests x 64 tokens ran at
  134 tok/s dequantizing from 64 rows, 188 tok/s from 128 (float32 weights: 206).
* with them: 512 rows. One layer's three MLP products, cache-resident, p25 of 15, on a
  2-core Zen 4 (2026-11-28, benches/RESULTS.md), kernel / dequantize + GEMM, ms: SmolLM2
  Q4_1 0.66 / 1.07 at 64 rows, 1.33 / 1.83 at 128, 2.85 / 3.50 at 256, 5.89 / 6.77 at
  512, 26.1 / 25.0 at 2,048; Qwen2.5-Coder-0.5B (Q5_0, Q4_K / Q6_K) 5.3 / 18.6 at 64,
  10.4 / 22.5 at 128, 42.2 / 41.7 at 512, 206 / 141 at 2,048.
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
"""Products of this many rows or more dequantize where the core has no multi-row integer
kernel for the format (module docs)."""
BLOCKED_DEQUANTIZE_ROWS = 512
"""The same where the integer path takes any row count (:func:`integer_blocks`)."""
MAX_MULTI_WEIGHTS = 4
"""Most weights one ``kvpage_qmatmul_multi_<kind>`` call takes (Rust's constant)."""


def _probe(name: str, kind: str) -> int:
    probe = getattr(core_library(), name, None)
    return int(probe(KINDS.index(kind))) if probe is not None and kind in KINDS else 0


@functools.cache
def integer_rows(kind: str) -> int:
    """Products of ``kind`` with up to this many rows take the core's integer path on
    this CPU (1 with the portable loop, 16 with AVX2, 32 with AVX-512 VNNI; 0 without
    the core)."""
    return _probe("kvpage_qmatmul_integer_rows", kind)


@functools.cache
def integer_blocks(kind: str) -> bool:
    """Whether products of more rows take it too, in blocks of :func:`integer_rows`
    (with AVX-512 VNNI)."""
    return bool(_probe("kvpage_qmatmul_integer_blocks", kind))


def dequantize_rows(kind: str) -> int:
    """Products of ``kind`` with this many rows or more dequantize (module docs)."""
    return BLOCKED_DEQUANTIZE_ROWS if integer_blocks(kind) else DEQUANTIZE_ROWS


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
    packed: bool = False,
) -> jax.Array:
    """float32 ``x [T, K] . dequant(w)^T`` by the core (lower for ``cpu`` only); with
    ``live_rows`` (an int32 scalar, ``0 <= live_rows <= T``) only ``x``'s first rows are
    multiplied and the result's other rows are zeros. ``invariant``: every row on the
    float path, so a row's result does not depend on the other rows (batch-invariant
    inference; ``kvpage_qmatmul_invariant_<kind>``). ``packed``: ``blocks`` are packed
    into tiles (``kvpage_qmatmul_tiles_<kind>``)."""
    rows = x.shape[0]
    live = jnp.asarray(rows if live_rows is None else live_rows, jnp.int32).reshape(1)
    name = f"kvpage_qmatmul_invariant_{kind}" if invariant else target(kind)
    if packed:
        if invariant or not tiles_available(kind):
            raise RuntimeError(f"no {kind} call on weights packed into tiles here")
        name = f"kvpage_qmatmul_tiles_{kind}"
    if invariant and not register(name):
        raise RuntimeError(f"this kvpage core has no {name} (rebuild it)")
    call = jax.ffi.ffi_call(name, jax.ShapeDtypeStruct((rows, blocks.shape[0]), jnp.float32))
    scales = () if row_scales is None else (row_scales,)
    return call(x.astype(jnp.float32), blocks, *scales, live)


TILE_KINDS = ("q4_0", "q4_1")
"""Formats with calls on weights packed into tiles (``kvpage.quant.tiles``)."""


def targets() -> list[str]:
    """Every FFI target of these calls, for every format (a stored executable may call
    any of them: ``runner/executable_store.py`` registers them before a load)."""
    names: list[str] = []
    for kind in KINDS:
        names += [target(kind), f"kvpage_dequantize_{kind}", f"kvpage_qmatmul_invariant_{kind}",
                  f"kvpage_qmatmul_multi_{kind}"]
        if kind in TILE_KINDS:
            names += [f"kvpage_qmatmul_tiles_{kind}", f"kvpage_qmatmul_multi_tiles_{kind}",
                      f"kvpage_dequantize_tiles_{kind}"]
    return names


def tiles_available(kind: str) -> bool:
    """Whether the core exports ``kind``'s calls on weights packed into tiles."""
    return (kind in TILE_KINDS and available(kind) and register(f"kvpage_qmatmul_tiles_{kind}")
            and register(f"kvpage_qmatmul_multi_tiles_{kind}")
            and register(f"kvpage_dequantize_tiles_{kind}"))


def multi_available(kind: str) -> bool:
    """Whether the core exports ``kind``'s several-weight call (registers it once)."""
    return available(kind) and register(f"kvpage_qmatmul_multi_{kind}")


def qmatmul_multi_call(
    x: jax.Array,
    weights: list[tuple[jax.Array, jax.Array | None]],
    kind: str,
    live_rows: jax.Array | int | None = None,
    packed: bool = False,
) -> list[jax.Array]:
    """float32 ``x [T, K] . dequant(w)^T`` for each ``(blocks, row_scales)`` of
    ``weights`` (1 to :data:`MAX_MULTI_WEIGHTS`, all of format ``kind``) in one call;
    each result equals :func:`qmatmul_call`'s (lower for ``cpu`` only). ``packed``: every
    weight is packed into tiles."""
    if not 1 <= len(weights) <= MAX_MULTI_WEIGHTS:
        raise ValueError(f"one call takes 1 to {MAX_MULTI_WEIGHTS} weights, got {len(weights)}")
    rows = x.shape[0]
    live = jnp.asarray(rows if live_rows is None else live_rows, jnp.int32).reshape(1)
    shapes = [jax.ShapeDtypeStruct((rows, blocks.shape[0]), jnp.float32) for blocks, _ in weights]
    name = f"kvpage_qmatmul_multi_tiles_{kind}" if packed else f"kvpage_qmatmul_multi_{kind}"
    call = jax.ffi.ffi_call(name, shapes)
    scales = [s for _, s in weights if s is not None]
    if scales and len(scales) != len(weights):
        raise ValueError("either every weight has row scales or none has")
    return list(call(x.astype(jnp.float32), *(b for b, _ in weights), *scales, live))


def dequantize_call(
    blocks: jax.Array, row_scales: jax.Array | None, kind: str, inner: int,
    packed: bool = False,
) -> jax.Array:
    """The float32 weight ``[N, inner]`` of stored ``blocks`` (``packed``: in tiles; lower
    for ``cpu`` only)."""
    name = f"kvpage_dequantize_tiles_{kind}" if packed else f"kvpage_dequantize_{kind}"
    call = jax.ffi.ffi_call(name, jax.ShapeDtypeStruct((blocks.shape[0], inner), jnp.float32))
    return call(blocks, *(() if row_scales is None else (row_scales,)))


@functools.cache
def vectorized() -> bool:
    """Whether the core runs these products with AVX2 here (else its portable loop)."""
    probe = getattr(core_library(), "kvpage_qmatmul_vectorized", None)
    return bool(probe()) if probe is not None else False
