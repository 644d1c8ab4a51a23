"""The product behind every expert weight: :func:`expert_matmul_nt`,
``y[n] = x[n] . W[expert_ids[n]]^T`` for rows ``x [N, in]`` and stacked weights
``W [E, out, in]``, reading only the experts some row uses. The MoE layers
(:mod:`kvpage.model.moe`: ``N = tokens * top_k`` routed rows) and the LoRA adapters
(:mod:`kvpage.model.linear`: each row through its adapter's ``A`` then ``B``) run on it.

Kernels, by platform:

* CPU with the host kernels on (the model runner's steps): the Rust core's expert-indexed
  kernel (``kernels/host/cpu_expert_matmul.py``) groups the rows by expert and streams
  each used expert's weight once, float or quantized GGUF blocks, so a one-token decode
  step of a top-4 MoE reads 4 experts' bytes;
* CUDA GPU (same switch): rows sorted by expert through the Pallas grouped matmul
  (``kernels/pallas/grouped_matmul.py``), float weights;
* otherwise, a few rows (``N <= E``): gather the used experts' weights and multiply row
  by row (reads ``N`` experts' weights);
* otherwise: sort the rows by expert and run ``jax.lax.ragged_dot`` (a grouped matmul:
  each expert's rows against its weight once).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from kvpage.kernels.host import cpu_expert_matmul as host
from kvpage.kernels.pallas.grouped_matmul import grouped_matmul
from kvpage.model.linear_kernels import host_kernels_enabled
from kvpage.quant.weights import QuantizedWeight

ExpertWeight = jax.Array | QuantizedWeight
"""A stacked expert weight ``[E, out, in]``: float, or quantized blocks."""


def _num_experts(w: ExpertWeight) -> int:
    return int(w.shape[0])


def _gathered(x: jax.Array, w: ExpertWeight, ids: jax.Array) -> jax.Array:
    if isinstance(w, QuantizedWeight):
        scales = None if w.row_scales is None else jnp.take(w.row_scales, ids, axis=0)
        blocks = jnp.take(w.blocks, ids, axis=0)
        rows = QuantizedWeight(blocks, w.kind, (ids.shape[0], *w.shape[1:]), w.dtype, scales)
        weight = rows.dequantize(x.dtype)
    else:
        weight = jnp.take(w, ids, axis=0)
    return jnp.einsum("ni,noi->no", x, weight, preferred_element_type=jnp.float32)


def _by_expert(x: jax.Array, ids: jax.Array, experts: int,
               grouped: Callable[[jax.Array, jax.Array], jax.Array]) -> jax.Array:
    """``grouped(rows sorted by expert, rows per expert)``, put back in ``x``'s order:
    the grouped-matmul calling convention of ``ragged_dot`` and the Pallas kernel."""
    order = jnp.argsort(ids)
    sizes = jnp.bincount(ids, length=experts).astype(jnp.int32)
    y = grouped(x[order], sizes)
    return jnp.zeros_like(y).at[order].set(y)


def _grouped(x: jax.Array, w: ExpertWeight, ids: jax.Array) -> jax.Array:
    weight = w.dequantize(x.dtype) if isinstance(w, QuantizedWeight) else w
    return _by_expert(x, ids, _num_experts(w), lambda rows, sizes: lax.ragged_dot(
        rows, jnp.swapaxes(weight, 1, 2), sizes, preferred_element_type=jnp.float32))


def expert_matmul_nt(x: jax.Array, w: ExpertWeight, ids: jax.Array,
                     live: jax.Array | None = None) -> jax.Array:
    """float32 ``[N, out]``: row ``n`` of ``x [N, in]`` times expert ``ids[n]``'s
    ``[out, in]`` weight transposed (see the module docstring for the kernels). ``live``:
    rows from it on are padding (the host kernel skips them). Weights packed for the
    one MoE host call (:mod:`kvpage.quant.tiles`) are read back in row order here."""
    if isinstance(w, QuantizedWeight):
        w = w.in_rows()
    rows = x.shape[0]

    def xla() -> jax.Array:
        return _gathered(x, w, ids) if rows <= _num_experts(w) else _grouped(x, w, ids)

    if not host_kernels_enabled():
        return xla()
    branches: dict[str, Any] = {}
    host = _host_kernel(x, w, ids, live)
    if host is not None:
        branches["cpu"] = host
    if not isinstance(w, QuantizedWeight):
        branches["cuda"] = lambda: _pallas_grouped(x, w, ids)
    return lax.platform_dependent(**branches, default=xla) if branches else xla()


def _pallas_grouped(x: jax.Array, w: jax.Array, ids: jax.Array) -> jax.Array:
    """The GPU branch: rows sorted by expert through the Pallas grouped matmul."""
    return _by_expert(x, ids, _num_experts(w), lambda rows, sizes: grouped_matmul(
        rows, w, sizes, preferred_element_type=jnp.float32, interpret=False))


def _host_kernel(x: jax.Array, w: ExpertWeight, ids: jax.Array, live: jax.Array | None
                 ) -> Any:
    """The CPU branch running the Rust core's expert-indexed kernel, or None."""
    experts = _num_experts(w)
    if isinstance(w, QuantizedWeight):
        if not host.available(w.kind):
            return None
        out = w.shape[1]
        blocks = w.blocks.reshape(experts * out, -1)
        scales = None if w.row_scales is None else w.row_scales.reshape(experts * out)
        return lambda: host.expert_qmatmul_call(
            x.astype(jnp.float32), blocks, scales, w.kind, ids, experts, live
        )
    if not host.available(jnp.dtype(w.dtype).name):
        return None
    return lambda: host.expert_matmul_call(x.astype(jnp.float32), w, ids, live)
