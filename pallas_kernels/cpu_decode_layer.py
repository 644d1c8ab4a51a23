"""A whole decoder layer of a decode step on the host CPU, as one XLA FFI custom call.

Owns :func:`decode_layer_call` and the registration of its target,
``kvpage_decode_layer`` (``rust/kernels/decoder_layer.rs``, exported by
``rust/kernels/xla_ffi_layer.rs``): RMSNorm, Q/K/V, RoPE, the K/V write into the paged
pools (updated in place: the pools are aliased to the results), paged attention, the
output product, RMSNorm and the SwiGLU MLP, with both residuals. XLA:CPU pays a few
microseconds per op; a layer traced op by op runs ~30 ops around its products, which at
one row cost SmolLM2 more than the products themselves (``benches/RESULTS.md``,
"Quantized weights").

Each linear weight is float32 ``[out, in]`` or a :class:`~kvpage.quant.QuantizedWeight`
(its blocks, and its row scales for int8), passed with its format's code: -1 for float,
else the index in :data:`pallas_kernels.cpu_qmatmul.KINDS`. Only the ``cpu`` platform has
the target: callers put the call in the ``cpu`` branch of ``lax.platform_dependent``.
The call has no derivative.

It is opt-in (``KVPAGE_CPU_DECODE_LAYER=1``): on the 2-core machine of
``benches/RESULTS.md`` a decode step ran no faster with it than with the traced layers,
whose products are the per-product host kernels (SmolLM2 Q4_1, one sequence: ~30 tok/s
with it, ~37 without, same hour).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from pallas_kernels._host_ffi import register
from pallas_kernels.cpu_qmatmul import KINDS

TARGET = "kvpage_decode_layer"
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def available() -> bool:
    """Whether the Rust layer is registered for the ``cpu`` platform (registers it once)."""
    return register(TARGET)


def enabled() -> bool:
    """Whether decode steps use it: ``KVPAGE_CPU_DECODE_LAYER=1`` and :func:`available`."""
    return os.environ.get("KVPAGE_CPU_DECODE_LAYER", "0") == "1" and available()


def weight_operands(weight: Any) -> tuple[int, jax.Array, jax.Array]:
    """``(format code, stored values, row scales)`` of one linear weight."""
    none = jnp.zeros((0,), jnp.float32)
    if hasattr(weight, "blocks"):  # a QuantizedWeight
        scales = none if weight.row_scales is None else weight.row_scales.astype(jnp.float32)
        return KINDS.index(weight.kind), weight.blocks, scales
    return -1, weight, none


def decode_layer_call(
    hidden: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    slot_mapping: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    input_norm: jax.Array,
    post_norm: jax.Array,
    weights: Sequence[Any],
    *,
    rms_norm_eps: float,
    sm_scale: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(out [T, D], k_pages, v_pages)`` of one layer over ``T`` decode rows (lower for
    ``cpu`` only); ``weights`` in the order of :data:`LINEARS`."""
    if len(weights) != len(LINEARS):
        raise ValueError(f"expected {len(LINEARS)} weights ({', '.join(LINEARS)})")
    operands = [weight_operands(w) for w in weights]
    kinds = jnp.asarray([code for code, _, _ in operands], jnp.int32)
    constants = jnp.asarray([rms_norm_eps, sm_scale], jnp.float32)
    call = jax.ffi.ffi_call(
        TARGET,
        (
            jax.ShapeDtypeStruct(hidden.shape, jnp.float32),
            jax.ShapeDtypeStruct(k_pages.shape, k_pages.dtype),
            jax.ShapeDtypeStruct(v_pages.shape, v_pages.dtype),
        ),
        input_output_aliases={6: 1, 7: 2},
    )
    flat = [array for _, values, scales in operands for array in (values, scales)]
    return call(
        hidden.astype(jnp.float32),
        cos.astype(jnp.float32),
        sin.astype(jnp.float32),
        slot_mapping.astype(jnp.int32),
        kv_lens.astype(jnp.int32),
        block_tables.astype(jnp.int32),
        k_pages,
        v_pages,
        input_norm.astype(jnp.float32),
        post_norm.astype(jnp.float32),
        constants,
        kinds,
        *flat,
    )
