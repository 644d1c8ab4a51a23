"""The mixture-of-experts feed-forward block: routing, and experts run only where routed.

This file owns :func:`moe_block` (router, top-k, the routed experts' SwiGLU / GeGLU, the
shared expert) and :func:`expert_matmul_nt`, the product behind every expert weight:
``y[n] = x[n] . W[expert_ids[n]]^T`` for rows ``x [N, in]`` (``N = tokens * top_k``,
one row per routed (token, expert) pair) and stacked expert weights ``W [E, out, in]``.

Experts compute only where tokens are routed -- never every expert for every token:

* CPU with the host kernels on (the model runner's steps): the Rust core's expert-indexed
  kernel (``kernels/host/cpu_expert_matmul.py``) groups the rows by expert and streams
  each routed expert's weight once, float or quantized GGUF blocks, so a one-token decode
  step reads ``top_k`` experts' bytes;
* CUDA GPU (same switch): rows sorted by expert through the Pallas grouped matmul
  (``kernels/pallas/grouped_matmul.py``), float weights;
* otherwise, a few rows (``N <= E``): gather the routed experts' weights and multiply
  row by row (reads ``N`` experts' weights);
* otherwise: sort the rows by expert and run ``jax.lax.ragged_dot`` (a grouped matmul:
  each expert's rows against its weight once).

:func:`dense_moe_block` computes every expert for every token and weights them by the
same routing: the reference for tests and the "dense-compute equivalent" of
``kvpage bench moe``; the engine never runs it.

Invariants: routing probabilities are computed in float32; the weights of a token's
``top_k`` experts sum to 1 when the model renormalises (``norm_topk_prob``, or
``router="topk_softmax"``); row ``t * top_k + j`` of the routed rows is token ``t``'s
``j``-th expert.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from kvpage.kernels.host import cpu_expert_matmul as host
from kvpage.kernels.pallas.grouped_matmul import grouped_matmul
from kvpage.model.config import ModelConfig
from kvpage.model.linear_kernels import host_kernels_enabled, live_rows_of, matmul_nt
from kvpage.model.mlp import activation_fn, gated_mlp
from kvpage.quant.weights import QuantizedWeight

ExpertWeight = jax.Array | QuantizedWeight
"""A stacked expert weight ``[E, out, in]``: float, or quantized blocks."""


def route(config: ModelConfig, router: dict[str, Any], x: jax.Array
          ) -> tuple[jax.Array, jax.Array]:
    """Each token's experts and their weights: ``(ids int32 [T, k], weights f32 [T, k])``."""
    moe = config.moe
    assert moe is not None
    logits = matmul_nt(x, router["weight"], preferred_element_type=jnp.float32)
    if "bias" in router:
        logits = logits + router["bias"].astype(jnp.float32)
    if moe.router == "topk_softmax":
        top, ids = lax.top_k(logits, moe.top_k)
        return ids.astype(jnp.int32), jax.nn.softmax(top, axis=-1)
    probs = jax.nn.softmax(logits, axis=-1)
    weights, ids = lax.top_k(probs, moe.top_k)
    if moe.norm_topk_prob:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return ids.astype(jnp.int32), weights


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
    rows from it on are padding (the host kernel skips them)."""
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


def _expert_activation(config: ModelConfig, gate: jax.Array, up: jax.Array) -> jax.Array:
    """``act(gate) * up``, or gpt-oss's clamped SwiGLU (:class:`MoEConfig`)."""
    moe = config.moe
    assert moe is not None
    if moe.swiglu_limit is None:
        return activation_fn(config.hidden_act)(gate) * up
    limit = moe.swiglu_limit
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(gate * moe.swiglu_alpha)


def _routed_experts(config: ModelConfig, experts: dict[str, Any], x: jax.Array,
                    ids: jax.Array, weights: jax.Array) -> jax.Array:
    tokens, k = ids.shape
    rows = jnp.repeat(x, k, axis=0)  # row t * k + j: token t's j-th expert
    flat = ids.reshape(-1)
    live_tokens = live_rows_of(tokens)
    live = None if live_tokens is None else live_tokens * k

    def product(name: str, inputs: jax.Array) -> jax.Array:
        y = expert_matmul_nt(inputs, experts[name]["weight"], flat, live)
        if "bias" in experts[name]:
            y = y + jnp.take(experts[name]["bias"], flat, axis=0).astype(jnp.float32)
        return y

    gate, up = product("gate_proj", rows), product("up_proj", rows)
    hidden = _expert_activation(config, gate, up).astype(x.dtype)
    out = product("down_proj", hidden)
    out = out.reshape(tokens, k, -1) * weights[..., None]
    return jnp.sum(out, axis=1)


def _shared_expert(config: ModelConfig, mlp: dict[str, Any], x: jax.Array) -> jax.Array:
    out = gated_mlp(mlp["shared_expert"], x, config.hidden_act).astype(jnp.float32)
    if "shared_expert_gate" in mlp:
        gate = matmul_nt(x, mlp["shared_expert_gate"]["weight"],
                         preferred_element_type=jnp.float32)
        out = jax.nn.sigmoid(gate) * out
    return out


def moe_block(config: ModelConfig, mlp: dict[str, Any], x: jax.Array) -> jax.Array:
    """The MoE feed-forward output ``[T, hidden]`` of normed hidden states ``x``."""
    assert config.moe is not None
    if config.moe.dense_compute:
        return dense_moe_block(config, mlp, x)
    ids, weights = route(config, mlp["gate"], x)
    out = _routed_experts(config, mlp["experts"], x, ids, weights)
    if "shared_expert" in mlp:
        out = out + _shared_expert(config, mlp, x)
    return out.astype(x.dtype)


def dense_moe_block(config: ModelConfig, mlp: dict[str, Any], x: jax.Array) -> jax.Array:
    """:func:`moe_block` computing every expert for every token (reference / baseline):
    the same kernels on ``tokens * num_experts`` rows, weighted by the same routing
    (zero for the experts a token was not routed to)."""
    moe = config.moe
    assert moe is not None
    ids, weights = route(config, mlp["gate"], x)
    tokens, experts = x.shape[0], moe.num_experts
    every = jnp.tile(jnp.arange(experts, dtype=jnp.int32), (tokens, 1))  # [T, E]
    dense_weights = jnp.zeros((tokens, experts), jnp.float32).at[
        jnp.arange(tokens)[:, None], ids
    ].set(weights)
    out = _routed_experts(config, mlp["experts"], x, every, dense_weights)
    if "shared_expert" in mlp:
        out = out + _shared_expert(config, mlp, x)
    return out.astype(x.dtype)
