"""The mixture-of-experts feed-forward block: routing, and experts run only where routed.

This file owns :func:`moe_block` (router, top-k, the routed experts' SwiGLU / GeGLU, the
shared expert). Experts compute only where tokens are routed, never every expert for
every token: each expert weight is a product of ``N = tokens * top_k`` rows (one per
routed (token, expert) pair) through :func:`kvpage.model.expert_matmul.expert_matmul_nt`,
which reads only the experts some row was routed to (its kernels: that module).

On CPU with the host kernels, quantized SwiGLU experts run as one host call per layer
instead (``cpu_expert_matmul.expert_ffn_call``: routing, the three products, the
activation and the weighted sum): as XLA's router ops and three expert calls, a
one-token step paid ~60 us a layer in hand-offs (``KVPAGE_MOE_ONE_CALL=0`` turns it
off; 2026-11-28, ``benches/RESULTS.md``).

:func:`dense_moe_block` computes every expert for every token and weights them by the
same routing: the reference for tests and the "dense-compute equivalent" of
``kvpage bench moe``; the engine never runs it.

Invariants: routing probabilities are computed in float32; the weights of a token's
``top_k`` experts sum to 1 when the model renormalises (``norm_topk_prob``, or
``router="topk_softmax"``); row ``t * top_k + j`` of the routed rows is token ``t``'s
``j``-th expert.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from kvpage.kernels.host import cpu_expert_matmul as host
from kvpage.model.config import ModelConfig
from kvpage.model.expert_matmul import expert_matmul_nt
from kvpage.model.linear_kernels import (
    batch_invariant_enabled,
    host_kernels_enabled,
    live_rows_of,
    matmul_nt,
)
from kvpage.model.mlp import activation_fn, gated_mlp
from kvpage.quant.weights import QuantizedWeight


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


ONE_CALL_ENV = "KVPAGE_MOE_ONE_CALL"
"""Set to 0, the routed experts run as XLA's router ops and three expert calls even where
one host call applies (for A/B runs; read when a step is traced)."""


def one_host_call_applies(config: ModelConfig, mlp: dict[str, Any]) -> bool:
    """Whether a layer's routed experts can run as one host call, the step's switches
    aside: quantized experts without row scales (gate and up in one format), SwiGLU
    without expert biases or clamping, a float router. (Packing experts into tiles at
    load asks this too: only that call reads them packed without unpacking them.)"""
    moe = config.moe
    assert moe is not None
    experts = mlp["experts"]
    gate, up, down = (experts[n]["weight"] for n in ("gate_proj", "up_proj", "down_proj"))
    quantized = all(isinstance(w, QuantizedWeight) for w in (gate, up, down))
    return (quantized and gate.kind == up.kind
            and host.expert_ffn_available(gate.kind, down.kind)
            and config.hidden_act == "silu" and moe.swiglu_limit is None
            and not any("bias" in experts[n] for n in experts)
            and not isinstance(mlp["gate"]["weight"], QuantizedWeight))


def _one_host_call(config: ModelConfig, mlp: dict[str, Any], x: jax.Array) -> Any:
    """The routed experts as one host call (``cpu_expert_matmul.expert_ffn_call``), or None
    where it does not apply: host kernels off or batch-invariant, or
    :func:`one_host_call_applies` false."""
    moe = config.moe
    assert moe is not None
    if (not host_kernels_enabled() or batch_invariant_enabled()
            or os.environ.get(ONE_CALL_ENV) == "0" or not one_host_call_applies(config, mlp)):
        return None
    experts = mlp["experts"]
    gate, up, down = (experts[n]["weight"] for n in ("gate_proj", "up_proj", "down_proj"))
    bias = mlp["gate"].get("bias")
    live = live_rows_of(x.shape[0])
    if gate.layout != up.layout:
        gate, up = gate.in_rows(), up.in_rows()
    packed = (gate.layout == "tiles16", down.layout == "tiles16")
    return lambda: host.expert_ffn_call(
        x, mlp["gate"]["weight"], bias, gate.blocks, up.blocks, down.blocks, gate.kind,
        down.kind, moe.top_k, moe.router, moe.norm_topk_prob, live, packed)


def moe_block(config: ModelConfig, mlp: dict[str, Any], x: jax.Array) -> jax.Array:
    """The MoE feed-forward output ``[T, hidden]`` of normed hidden states ``x``."""
    assert config.moe is not None
    if config.moe.dense_compute:
        return dense_moe_block(config, mlp, x)

    def in_xla() -> jax.Array:
        ids, weights = route(config, mlp["gate"], x)
        return _routed_experts(config, mlp["experts"], x, ids, weights)

    host_call = _one_host_call(config, mlp, x)
    out = in_xla() if host_call is None else lax.platform_dependent(cpu=host_call,
                                                                     default=in_xla)
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
