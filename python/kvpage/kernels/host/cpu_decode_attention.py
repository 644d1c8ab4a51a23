"""Decode attention on the host CPU, as an XLA FFI custom call into kvpage's Rust core.

Owns :func:`cpu_paged_decode_attention` and the registration of its FFI target. XLA:CPU
gathers paged K/V blocks at ~5 GB/s, which made decode attention over long contexts the
largest cost of a CPU step; the Rust kernel (``rust/kernels/cpu_attention.rs``, exported by
``rust/kernels/xla_ffi_attention.rs``) reads each live block once, in place, on all cores.

Contract: ``q [S, Hq, D]`` (one query token per row), the paged pools, ``kv_lens [S]``
(0 for rows not computed: they get zeros) and ``block_tables [S, M]``; result
``[S, Hq, D]`` float32, equal to the reference's decode rows. With ``table_rows``
(int32 ``[S]``, ABI 3) row ``r`` reads ``block_tables[table_rows[r]]``, so the query
tokens of one sequence share its table row instead of a gathered copy each. Only the
``cpu`` platform has the target: :func:`cpu_paged_decode_attention` takes the function to
lower on any other platform (``lax.platform_dependent``), so one traced program still
lowers for GPUs.

Options (``reference.py``): with ``sliding_window``, ``logit_soft_cap`` or ``sinks`` the
call takes three more operands, ``sliding_window`` int32 ``[1]`` (0: none),
``soft_cap`` float32 ``[1]`` (0: none) and ``sinks`` float32 ``[Hq]`` (-inf: none); the
kernel starts each row at the first block its window touches and never reads the table
entries before it. Without them the call is the five-operand one. A core built before
the options (``kvpage_paged_decode_attention_abi`` missing) gets ``otherwise()`` for calls
with options.

``KVPAGE_CPU_ATTENTION=0`` turns the kernel off (the ``lax`` loop is used everywhere).
Under XLA its rows are split over XLA's own intra-op thread pool (``rust/kernels/parallel.rs``);
``KVPAGE_CPU_ATTENTION_THREADS`` caps the threads of direct (non-XLA) calls only.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from kvpage.kernels.host._host_ffi import core_library, register

TARGET = "kvpage_paged_decode_attention"


def available() -> bool:
    """Whether the Rust kernel is registered for the ``cpu`` platform (registers it once)."""
    return os.environ.get("KVPAGE_CPU_ATTENTION", "1") != "0" and register(TARGET)


def kernel_abi() -> int:
    """The operand layout the compiled core's kernel takes (0: none reported)."""
    library = core_library()
    abi = None if library is None else getattr(library, "kvpage_paged_decode_attention_abi", None)
    return 0 if abi is None else int(abi())


def supports_options() -> bool:
    """Whether the compiled core's kernel takes the window / soft-cap / sinks operands."""
    return kernel_abi() >= 2


def cpu_paged_decode_attention(
    q: jax.Array,
    k_pages: jax.Array,
    v_pages: jax.Array,
    kv_lens: jax.Array,
    block_tables: jax.Array,
    *,
    sm_scale: float,
    otherwise: Callable[[], jax.Array],
    sliding_window: int | None = None,
    logit_soft_cap: float | None = None,
    sinks: jax.Array | None = None,
    table_rows: jax.Array | None = None,
) -> jax.Array:
    """Decode rows' attention ``[S, Hq, D]`` float32: the Rust kernel when lowered for
    CPU, ``otherwise()`` (same result) when lowered for any other platform.

    ``table_rows`` (int32 ``[S]``): the row of ``block_tables`` (then ``[N, M]``) each
    query row reads; None: its own."""
    if not available() or k_pages.dtype not in (jnp.float32, jnp.float16, jnp.bfloat16):
        return otherwise()
    with_options = not (sliding_window is None and logit_soft_cap is None and sinks is None)
    if with_options and not supports_options():
        return otherwise()
    if table_rows is not None and kernel_abi() < 3:  # a core built before table_rows
        block_tables, table_rows = block_tables[table_rows], None
    with_options |= table_rows is not None
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))

    def on_cpu() -> jax.Array:
        operands = [
            q.astype(jnp.float32) * sm_scale,
            k_pages,
            v_pages,
            kv_lens.astype(jnp.int32),
            block_tables.astype(jnp.int32),
        ]
        if with_options:
            operands += [
                jnp.asarray([sliding_window or 0], jnp.int32),
                jnp.asarray([logit_soft_cap or 0.0], jnp.float32),
                jnp.full((q.shape[1],), -jnp.inf, jnp.float32)
                if sinks is None
                else sinks.astype(jnp.float32),
            ]
        if table_rows is not None:
            operands.append(table_rows.astype(jnp.int32))
        return call(*operands)

    return lax.platform_dependent(cpu=on_cpu, default=otherwise)
