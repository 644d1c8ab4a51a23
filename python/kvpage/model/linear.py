"""A linear layer of the params tree: :func:`linear` (``x @ weight.T``, its bias, and,
inside :func:`~kvpage.model.linear_kernels.lora_slots`, each row's LoRA adapter through
:func:`lora_delta`). Which kernel the product runs on is
:mod:`kvpage.model.linear_kernels`'s."""

from __future__ import annotations

from typing import Any

import jax

from kvpage.model.expert_matmul import expert_matmul_nt
from kvpage.model.linear_kernels import lora_slots_of, matmul_nt, matmuls_nt


def linear(x: jax.Array, layer: dict[str, Any]) -> jax.Array:
    """A linear layer: ``x @ weight.T (+ bias)`` with an HF-oriented ``[out, in]`` weight,
    in ``x``'s dtype."""
    return _finish(x, layer, matmul_nt(x, layer["weight"]))


def linears(x: jax.Array, layers: list[dict[str, Any]]) -> list[jax.Array]:
    """``[linear(x, layer) for layer in layers]``: layers reading the same ``x`` (a
    layer's q/k/v, gate and up), whose products may run in one kernel call
    (:func:`~kvpage.model.linear_kernels.matmuls_nt`)."""
    ys = matmuls_nt(x, [layer["weight"] for layer in layers])
    return [_finish(x, layer, y) for layer, y in zip(layers, ys, strict=True)]


def _finish(x: jax.Array, layer: dict[str, Any], y: jax.Array) -> jax.Array:
    """The product ``y`` of ``x`` and ``layer``'s weight, plus its bias and LoRA delta."""
    if "bias" in layer:
        y = y + layer["bias"]
    slots = lora_slots_of()
    if "lora_a" in layer and slots is not None:
        y = y + lora_delta(x, layer["lora_a"], layer["lora_b"], slots)
    return y.astype(x.dtype)


def lora_delta(x: jax.Array, a: jax.Array, b: jax.Array, slots: jax.Array) -> jax.Array:
    """float32 ``x[t] . A[slots[t]]^T . B[slots[t]]^T``: each row through its own adapter
    (``a [L, r, in]``, ``b [L, out, r]``, the scale folded into ``b``), as two
    expert-indexed products (:func:`~kvpage.model.expert_matmul.expert_matmul_nt`: on CPU
    the Rust kernel reads each adapter in use once per call; on a GPU the Pallas grouped
    matmul)."""
    flat = x.reshape(-1, x.shape[-1])
    shrunk = expert_matmul_nt(flat, a, slots)
    out = expert_matmul_nt(shrunk.astype(b.dtype), b, slots)
    return out.reshape(*x.shape[:-1], b.shape[1])
