"""Mixture-of-experts linear layers on the host CPU, as XLA FFI custom calls.

Owns :func:`expert_qmatmul_call` (quantized experts) and :func:`expert_matmul_call`
(float32 or bfloat16 experts): ``y[n] = x[n] . W[expert_ids[n]]^T`` for the ``N =
tokens * top_k`` rows of a routed MoE layer, by the Rust core's
``rust/kernels/expert_matmul.rs`` (exported by ``rust/kernels/xla_ffi_experts.rs``).

The contract, for both calls:

* ``x [N, K]`` (cast to float32), ``expert_ids`` ``N`` int32 ids (any shape of ``N``
  elements, e.g. the router's ``[tokens, top_k]`` flattened in the order of ``x``'s
  rows); the result is float32 ``[N, M]``.
* The experts are one buffer, expert ``e`` after expert ``e - 1``. Quantized: ``blocks``
  ``[E * M, row_bytes(kind, K)]`` (the GGUF blocks of the ``E`` stacked ``[M, K]``
  weights: expert ``e``'s rows are ``e * M .. (e + 1) * M``; ``[E, M, row_bytes]`` is
  taken too) and, for ``int8``, ``row_scales [E * M]`` float32; the formats are
  :data:`KINDS` (``kvpage.quant.formats``). Float: ``w [E, M, K]``, float32 or
  bfloat16, read as stored.
* Each call registers its target with JAX (once) when traced.
* Only the first ``live_rows`` rows (an int32 scalar, ``0 <= live_rows <= N``; all rows
  when None) are computed; the others are zeros and their ids are never read: a
  padded step's padding rows cost nothing. A live row's id outside ``[0, E)`` makes
  the call fail (an XLA runtime error), never an out-of-bounds read.
* The rows are grouped by expert, so each expert some live row is routed to is read
  from memory once per call, however many rows it serves, and the others are not read
  at all: a one-token decode step with top-4 of 32 experts reads 4 experts' bytes.
  Each expert's rows go through the dense kernels (``cpu_qmatmul``, ``cpu_matmul``), so
  a row's rounding is that of a dense product of the rows sharing its expert (a
  quantized row alone on its expert takes the 16-bit one-row path).

Only the ``cpu`` platform has the targets; callers put these calls in the ``cpu`` branch
of ``lax.platform_dependent`` (as ``kvpage/model/linear_kernels.py`` does for
``cpu_qmatmul``), so one traced program still lowers for GPUs. The calls have no
derivative. ``KVPAGE_CPU_MATMUL_PORTABLE=1`` (read by the core) makes them use the
portable loops.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kvpage.kernels.host._host_ffi import register
from kvpage.quant import formats

# Quantized formats, in the order of Rust's QuantType::ALL (kvpage.quant.formats).
KINDS: tuple[str, ...] = formats.KINDS
# Float expert dtypes (one target, ``kvpage_expert_matmul``, reads either).
FLOAT_KINDS: tuple[str, ...] = ("float32", "bfloat16")
FLOAT_TARGET = "kvpage_expert_matmul"


def target(kind: str) -> str:
    """The FFI target of ``kind`` (a quantized format or a float dtype name)."""
    return FLOAT_TARGET if kind in FLOAT_KINDS else f"kvpage_expert_qmatmul_{kind}"


def targets() -> tuple[str, ...]:
    """Every target this module calls (for registering them all up front)."""
    return tuple(target(kind) for kind in KINDS) + (FLOAT_TARGET,)


def available(kind: str) -> bool:
    """Whether the core exports (and JAX now has registered) the expert product for
    ``kind``: a quantized format of :data:`KINDS` or a float dtype of
    :data:`FLOAT_KINDS`."""
    return (kind in KINDS or kind in FLOAT_KINDS) and register(target(kind))


def _registered(kind: str) -> str:
    """``kind``'s target, registered for the ``cpu`` platform (RuntimeError without it)."""
    if not available(kind):
        raise RuntimeError(f"kvpage._core does not export {target(kind)}")
    return target(kind)


def _rows_and_live(
    x: jax.Array, expert_ids: jax.Array, live_rows: jax.Array | int | None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    if x.ndim != 2:
        raise ValueError(f"x must be [N, K], got shape {x.shape}")
    rows = x.shape[0]
    if expert_ids.size != rows:
        raise ValueError(
            f"expert_ids must hold one id per row of x ({rows}), got shape {expert_ids.shape}"
        )
    ids = jnp.asarray(expert_ids).astype(jnp.int32).reshape(rows)
    live = jnp.asarray(rows if live_rows is None else live_rows, jnp.int32).reshape(1)
    return x.astype(jnp.float32), ids, live


def expert_qmatmul_call(
    x: jax.Array,
    blocks: jax.Array,
    row_scales: jax.Array | None,
    kind: str,
    expert_ids: jax.Array,
    num_experts: int,
    live_rows: jax.Array | int | None = None,
) -> jax.Array:
    """float32 ``[N, M]``: ``x[n] . dequant(W[expert_ids[n]])^T`` for the first
    ``live_rows`` rows, zeros after, with ``num_experts`` quantized experts stacked in
    ``blocks`` (module docs; lower for ``cpu`` only)."""
    if kind not in KINDS:
        raise ValueError(f"unknown quantized format {kind!r}; known: {', '.join(KINDS)}")
    x, ids, live = _rows_and_live(x, jnp.asarray(expert_ids), live_rows)
    inner = x.shape[1]
    want_bytes = formats.row_bytes(kind, inner)
    experts = int(num_experts)
    if blocks.ndim == 2 and experts > 0 and blocks.shape[0] % experts == 0:
        blocks = blocks.reshape(experts, blocks.shape[0] // experts, blocks.shape[1])
    if blocks.ndim != 3 or blocks.shape[0] != experts or blocks.shape[2] != want_bytes:
        raise ValueError(
            f"{kind} blocks of {experts} experts with {inner} inputs must be "
            f"[{experts} * M, {want_bytes}], got shape {blocks.shape}"
        )
    outs = blocks.shape[1]
    scales: tuple[jax.Array, ...] = ()
    if kind in formats.ROW_SCALED:
        if row_scales is None or row_scales.size != experts * outs:
            raise ValueError(f"{kind} experts need row_scales of {experts * outs} values")
        scales = (jnp.asarray(row_scales, jnp.float32).reshape(experts * outs),)
    call = jax.ffi.ffi_call(
        _registered(kind), jax.ShapeDtypeStruct((x.shape[0], outs), jnp.float32)
    )
    return call(x, blocks, *scales, ids, live)


def expert_matmul_call(
    x: jax.Array,
    w: jax.Array,
    expert_ids: jax.Array,
    live_rows: jax.Array | int | None = None,
) -> jax.Array:
    """float32 ``[N, M]``: ``x[n] . w[expert_ids[n]]^T`` for the first ``live_rows``
    rows, zeros after; ``w [E, M, K]`` float32 or bfloat16 (module docs; lower for
    ``cpu`` only)."""
    x, ids, live = _rows_and_live(x, jnp.asarray(expert_ids), live_rows)
    if w.ndim != 3 or w.shape[2] != x.shape[1]:
        raise ValueError(f"w must be [E, M, {x.shape[1]}], got shape {w.shape}")
    if jnp.dtype(w.dtype).name not in FLOAT_KINDS:
        raise ValueError(f"w must be float32 or bfloat16, got {w.dtype}")
    call = jax.ffi.ffi_call(
        _registered(jnp.dtype(w.dtype).name),
        jax.ShapeDtypeStruct((x.shape[0], w.shape[1]), jnp.float32),
    )
    return call(x, w, ids, live)
