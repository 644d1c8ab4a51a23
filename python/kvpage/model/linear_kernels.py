"""Which kernel the linear layers of a traced model run on.

Owns :func:`matmul_nt` (``x . w^T`` with an HF-oriented ``[out, in]`` weight, the
product behind every linear layer and the vocab projection), :func:`embedding_rows`
and the switches a step is traced under: :func:`host_matmuls`, :func:`live_rows`,
:func:`lora_slots` (each row's adapter) and :func:`batch_invariant`. A weight may be a
:class:`~kvpage.quant.QuantizedWeight`: with the switch on, its products run in the Rust
core from its blocks (``kernels/host/cpu_qmatmul.py``: the kernel for up to 127 rows, the
core's dequantization + XLA's GEMM for more), and an int8
one on a CUDA GPU in the Pallas kernel ``kernels/pallas/int8_matmul.py``; otherwise, or on
another platform, the step dequantizes it and uses XLA's dot. For float weights, with
the switch on, products of a few rows lowered for CPU go to kvpage's Rust kernel
(``kernels/host/cpu_matmul.py``: policy and measurements); with it off, or on any other
platform, they are XLA's ``dot_general``.

A traced step may also say how many of its rows are live (:func:`live_rows`): the
quantized host kernel then leaves the padding rows out (their results are zeros).

The switch is off by default: the kernel has no derivative, so the training path
(:mod:`kvpage.model.dense` under ``jax.grad``) never meets it. The model runner turns
it on while it traces its step, and only without a device mesh (a custom call between
sharded weights would make the partitioner gather them). The switch is read when a
function is traced, and JAX caches traces per function object: trace a function with
the switch in one state only (the runner builds a fresh step function per executable).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from kvpage.kernels.host import cpu_qmatmul
from kvpage.kernels.host.cpu_matmul import cpu_matmul_nt
from kvpage.kernels.pallas.int8_matmul import int8_matmul_nt
from kvpage.model.transposed_weight import TransposedWeight
from kvpage.quant.weights import QuantizedWeight

_HOST_MATMULS = contextvars.ContextVar("kvpage_host_matmuls", default=False)
_LORA_SLOTS: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar(
    "kvpage_lora_slots", default=None
)
_BATCH_INVARIANT = contextvars.ContextVar("kvpage_batch_invariant", default=False)
_LIVE_ROWS: contextvars.ContextVar[tuple[int, jax.Array] | None] = contextvars.ContextVar(
    "kvpage_live_rows", default=None
)


@contextlib.contextmanager
def host_matmuls(enabled: bool = True) -> Iterator[None]:
    """Within the block, :func:`matmul_nt` may trace the host kernel (see module docs)."""
    token = _HOST_MATMULS.set(enabled)
    try:
        yield
    finally:
        _HOST_MATMULS.reset(token)


@contextlib.contextmanager
def live_rows(rows: int, live: jax.Array) -> Iterator[None]:
    """Within the block, products of ``rows`` input rows may skip rows ``live`` and up
    (an int32 device scalar): the caller promises those rows are padding, whose results
    nobody reads. Products of another row count are not affected."""
    token = _LIVE_ROWS.set((rows, live))
    try:
        yield
    finally:
        _LIVE_ROWS.reset(token)


def live_rows_of(rows: int) -> jax.Array | None:
    """The live row count of a product of ``rows`` rows inside :func:`live_rows`, or None."""
    scope = _LIVE_ROWS.get()
    return scope[1] if scope is not None and scope[0] == rows else None


@contextlib.contextmanager
def lora_slots(slots: jax.Array | None) -> Iterator[None]:
    """Within the block, :func:`kvpage.model.linear.linear` adds each row's LoRA
    adapter: row ``t`` uses the layer's adapter stack entry ``slots[t]`` (int32 ``[T]``;
    entry 0 holds zeros, for rows without an adapter). Outside it, or with None, adapters
    are ignored."""
    token = _LORA_SLOTS.set(slots)
    try:
        yield
    finally:
        _LORA_SLOTS.reset(token)


@contextlib.contextmanager
def batch_invariant(enabled: bool = True) -> Iterator[None]:
    """Within the block (with :func:`host_matmuls` on), every product and the attention
    run kernels whose result for a row does not depend on the other rows of the step:
    float32 and quantized weights through the Rust kernels at every row count (the
    quantized ones on their float path), attention per query token
    (:mod:`kvpage.model.self_attention`). Other weight layouts raise."""
    token = _BATCH_INVARIANT.set(enabled)
    try:
        yield
    finally:
        _BATCH_INVARIANT.reset(token)


def lora_slots_of() -> jax.Array | None:
    """The LoRA slots of the rows of a function traced now (:func:`lora_slots`), or None."""
    return _LORA_SLOTS.get()


def batch_invariant_enabled() -> bool:
    """Whether a function traced now must be batch-invariant (:func:`batch_invariant`)."""
    return _BATCH_INVARIANT.get() and _HOST_MATMULS.get()


def host_kernels_enabled() -> bool:
    """Whether a function traced now may use the host kernels (see :func:`host_matmuls`)."""
    return _HOST_MATMULS.get()


def matmul_nt(
    x: jax.Array,
    w: jax.Array | QuantizedWeight | TransposedWeight,
    preferred_element_type: jax.typing.DTypeLike | None = None,
) -> jax.Array:
    """``x [..., in] . w [out, in]^T`` (``lax.dot_general`` contracting ``x``'s last axis
    with ``w``'s axis 1; a transposed weight's kernel ``[in, out]`` on its axis 0)."""
    if isinstance(w, QuantizedWeight):
        return _quantized_matmul_nt(x, w, preferred_element_type)
    invariant = batch_invariant_enabled()
    if invariant and (isinstance(w, TransposedWeight) or w.dtype != jnp.float32):
        raise NotImplementedError(
            "batch_invariant runs float32 [out, in] and GGUF-quantized weights; this "
            f"model has a {type(w).__name__} of dtype {w.dtype}"
        )
    if isinstance(w, TransposedWeight):
        dims = (((x.ndim - 1,), (0,)), ((), ()))
        return lax.dot_general(
            x, w.as_in_out(), dims, preferred_element_type=preferred_element_type
        )

    def xla() -> jax.Array:
        dims = (((x.ndim - 1,), (1,)), ((), ()))
        return lax.dot_general(x, w, dims, preferred_element_type=preferred_element_type)

    if not _HOST_MATMULS.get():
        return xla()
    if invariant:
        flat = x.reshape(-1, x.shape[-1]).astype(jnp.float32)
        y = cpu_matmul_nt(flat, w, otherwise=lambda: xla().reshape(flat.shape[0], -1),
                          every_row_count=True)
        return y.reshape(*x.shape[:-1], w.shape[0]).astype(preferred_element_type or x.dtype)
    return cpu_matmul_nt(x, w, otherwise=xla)


def matmuls_nt(x: jax.Array, ws: list[Any]) -> list[jax.Array]:
    """``[matmul_nt(x, w) for w in ws]``; on CPU, quantized weights of one format that the
    host kernel would multiply one by one (a layer's q/k/v, gate and up) go in one call
    (``cpu_qmatmul.qmatmul_multi_call``: ``x`` prepared once, one hand-over to the
    thread pool; each result the same as alone)."""
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]
    kinds = {(w.kind, w.layout) if isinstance(w, QuantizedWeight) else None for w in ws}
    kind, layout = kinds.pop() if len(kinds) == 1 and None not in kinds else (None, None)
    packed = layout == "tiles16"
    if (
        kind is None
        or (packed and not cpu_qmatmul.tiles_available(kind))
        or not 2 <= len(ws) <= cpu_qmatmul.MAX_MULTI_WEIGHTS
        or not _HOST_MATMULS.get()
        or batch_invariant_enabled()
        or rows >= cpu_qmatmul.dequantize_rows(kind)
        or not cpu_qmatmul.multi_available(kind)
    ):
        return [matmul_nt(x, w) for w in ws]

    def on_cpu() -> list[jax.Array]:
        return cpu_qmatmul.qmatmul_multi_call(
            flat, [(w.blocks, w.row_scales) for w in ws], kind, live_rows_of(rows), packed
        )

    def one_by_one() -> list[jax.Array]:
        return [matmul_nt(flat, w).astype(jnp.float32) for w in ws]

    ys = lax.platform_dependent(cpu=on_cpu, default=one_by_one)
    shaped = zip(ys, ws, strict=True)
    return [y.reshape(*x.shape[:-1], w.shape[0]).astype(x.dtype) for y, w in shaped]


def _quantized_matmul_nt(
    x: jax.Array, w: QuantizedWeight, preferred_element_type: jax.typing.DTypeLike | None
) -> jax.Array:
    out_dtype = preferred_element_type or x.dtype
    dims = (((x.ndim - 1,), (1,)), ((), ()))

    def xla() -> jax.Array:
        return lax.dot_general(
            x, w.dequantize(x.dtype), dims, preferred_element_type=preferred_element_type
        )

    if not _HOST_MATMULS.get():
        return xla()
    flat = x.reshape(-1, x.shape[-1])
    rows = flat.shape[0]

    def dequantized() -> jax.Array:
        return xla().reshape(rows, -1).astype(jnp.float32)

    def on_cpu() -> jax.Array:
        # Weights packed into tiles take the tile kernels; the invariant path their rows.
        packed = w.layout == "tiles16" and cpu_qmatmul.tiles_available(w.kind)
        blocks = w.blocks if packed else w.in_rows().blocks
        if batch_invariant_enabled():
            return cpu_qmatmul.qmatmul_call(flat, w.in_rows().blocks, w.row_scales, w.kind,
                                            live_rows_of(rows), invariant=True)
        if rows < cpu_qmatmul.dequantize_rows(w.kind):
            return cpu_qmatmul.qmatmul_call(
                flat, blocks, w.row_scales, w.kind, live_rows_of(rows), packed=packed
            )
        weight = cpu_qmatmul.dequantize_call(blocks, w.row_scales, w.kind, w.shape[1], packed)
        return lax.dot_general(flat.astype(jnp.float32), weight, dims,
                               preferred_element_type=jnp.float32)

    def on_cuda() -> jax.Array:
        # int8: the Pallas kernel reads the int8 tiles (never a float copy).
        y = int8_matmul_nt(flat, w.blocks, w.row_scales, interpret=False)
        return y.astype(jnp.float32)

    branches: dict[str, Any] = {}
    if cpu_qmatmul.available(w.kind):
        branches["cpu"] = on_cpu
    if w.kind == "int8":
        branches["cuda"] = on_cuda
    y = lax.platform_dependent(**branches, default=dequantized) if branches else dequantized()
    return y.reshape(*x.shape[:-1], w.shape[0]).astype(out_dtype)


def embedding_rows(weight: jax.Array | QuantizedWeight, token_ids: jax.Array) -> jax.Array:
    """Rows ``token_ids`` of an embedding table (a quantized one dequantizes only them)."""
    if isinstance(weight, QuantizedWeight):
        return weight.take_rows(token_ids)
    return jnp.take(weight, token_ids, axis=0)
