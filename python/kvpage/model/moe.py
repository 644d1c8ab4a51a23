"""The mixture-of-experts feed-forward block: routing, and experts run only where routed.

This file owns :func:`moe_block` (router, top-k, the routed experts' SwiGLU / GeGLU, the
shared expert). Experts compute only where tokens are routed, never every expert for
every token: each expert weight is a product of ``N = tokens * top_k`` rows (one per
routed (token, expert) pair) through :func:`kvpage.model.expert_matmul.expert_matmul_nt`,
which reads only the experts some row was routed to (its kernels: that module).

:func:`dense_moe_block` computes every expert for every token and weights them by the
same routing: the reference for tests and the "dense-compute equivalent" of
``kvpage bench moe``; the engine never runs it.

Invariants: routing probabilities are computed in float32; the weights of a token's
``top_k`` experts sum to 1 when the model renormalises (``norm_topk_prob``, or
``router="topk_softmax"``); row ``t * top_k + j`` of the routed rows is token ``t``'s
``j``-th expert.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from kvpage.model.config import ModelConfig
from kvpage.model.expert_matmul import expert_matmul_nt
from kvpage.model.linear_kernels import live_rows_of, matmul_nt
from kvpage.model.mlp import activation_fn, gated_mlp


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
