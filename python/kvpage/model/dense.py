"""A dense (unpaged) causal forward pass over the same parameter pytree, for training.

This file owns :func:`dense_logits` and :func:`causal_lm_loss`: the Llama-family decoder
of :mod:`kvpage.model.decoder` applied to a ``[batch, length]`` block of token ids with an
ordinary causal mask and no KV cache. It shares the building blocks (RMSNorm, linear
layers, RoPE, logits) with the paged inference path, so a model trained through these
functions generates through the engine exactly as it was trained -- the params pytree
(:mod:`kvpage.model.params` layout) goes from the optimizer to ``LLM.update_params``
untouched.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from kvpage.model.config import SLIDING_ATTENTION, ModelConfig
from kvpage.model.decoder import compute_logits, embed_tokens, feed_forward, layer_params
from kvpage.model.linear import linear
from kvpage.model.norms import rms_norm
from kvpage.model.params import Params
from kvpage.model.rope import apply_rope, config_rope_cos_sin
from kvpage.model.self_attention import qk_norms


def _attention(
    config: ModelConfig, attn: Params, x: jax.Array, positions: jax.Array, layer_type: str
) -> jax.Array:
    batch, length, _ = x.shape
    d, hq, hkv = config.head_dim, config.num_heads, config.num_kv_heads
    flat = x.reshape(batch * length, -1)
    q = linear(flat, attn["q_proj"]).reshape(batch * length, hq, d)
    k = linear(flat, attn["k_proj"]).reshape(batch * length, hkv, d)
    v = linear(flat, attn["v_proj"]).reshape(batch * length, hkv, d)
    if config.qk_norm:
        q, k = qk_norms(config, attn, q, k)
    rope = config.rope_local if layer_type == SLIDING_ATTENTION else None
    cos, sin = config_rope_cos_sin(config, positions, rope=rope)
    q = apply_rope(q, cos, sin).reshape(batch, length, hkv, hq // hkv, d)
    k = apply_rope(k, cos, sin).reshape(batch, length, hkv, d)
    v = v.reshape(batch, length, hkv, d)
    scale = config.query_scale if config.query_scale is not None else d**-0.5
    scores = jnp.einsum("bqhgd,bkhd->bhgqk", q, k, preferred_element_type=jnp.float32) * scale
    if config.attn_logit_softcap is not None:
        cap = config.attn_logit_softcap
        scores = jnp.tanh(scores / cap) * cap
    query, key = jnp.arange(length)[:, None], jnp.arange(length)[None, :]
    visible = key <= query
    if layer_type == SLIDING_ATTENTION:
        visible &= key > query - config.sliding_window
    scores = jnp.where(visible, scores, -jnp.inf)
    if config.attention_sinks:  # one extra logit per head in the denominator
        sinks = attn["sinks"].astype(jnp.float32).reshape(1, hkv, hq // hkv, 1, 1)
        sinks = jnp.broadcast_to(sinks, (*scores.shape[:-1], 1))
        weights = jax.nn.softmax(jnp.concatenate([scores, sinks], axis=-1), axis=-1)
        weights = weights[..., :-1].astype(v.dtype)
    else:
        weights = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum("bhgqk,bkhd->bqhgd", weights, v).reshape(batch * length, hq * d)
    return linear(out.astype(x.dtype), attn["o_proj"]).reshape(batch, length, -1)


def dense_hidden_states(params: Params, config: ModelConfig, token_ids: jax.Array) -> jax.Array:
    """Last-layer hidden states ``[B, L, hidden]`` (before the final norm)."""
    batch, length = token_ids.shape
    hidden = embed_tokens(params, token_ids, config)
    positions = jnp.tile(jnp.arange(length, dtype=jnp.int32), batch)
    eps, offset = config.rms_norm_eps, config.norm_offset
    for i in range(config.num_layers):
        layer = layer_params(params, i)

        def norm(x: jax.Array, name: str, layer: Any = layer) -> jax.Array:
            return rms_norm(x, layer[name]["weight"], eps, offset)

        attn = _attention(config, layer["self_attn"], norm(hidden, "input_layernorm"),
                          positions, config.layer_type(i))
        pre_mlp = "post_attention_layernorm"
        if config.sandwich_norms:
            attn = norm(attn, "post_attention_layernorm")
            pre_mlp = "pre_feedforward_layernorm"
        hidden = hidden + attn
        flat = norm(hidden, pre_mlp).reshape(batch * length, -1)
        out = feed_forward(config, layer["mlp"], flat).reshape(batch, length, -1)
        if config.sandwich_norms:
            out = norm(out, "post_feedforward_layernorm")
        hidden = hidden + out
    return hidden


def dense_logits(params: Params, config: ModelConfig, token_ids: jax.Array) -> jax.Array:
    """float32 next-token logits ``[B, L, vocab]`` of int ``token_ids`` ``[B, L]``."""
    batch, length = token_ids.shape
    hidden = dense_hidden_states(params, config, token_ids)
    logits = compute_logits(params, config, hidden.reshape(batch * length, -1))
    return logits.reshape(batch, length, -1)


def token_logprobs(params: Params, config: ModelConfig, token_ids: jax.Array) -> jax.Array:
    """``log p(token_ids[:, t + 1] | token_ids[:, :t + 1])`` as ``[B, L - 1]`` float32."""
    logits = dense_logits(params, config, token_ids[:, :-1])
    logp = jax.nn.log_softmax(logits, axis=-1)
    return jnp.take_along_axis(logp, token_ids[:, 1:, None], axis=-1)[..., 0]


def causal_lm_loss(
    params: Params, config: ModelConfig, token_ids: jax.Array, mask: jax.Array | None = None
) -> jax.Array:
    """Mean next-token cross-entropy of ``token_ids`` ``[B, L]``.

    ``mask`` ``[B, L - 1]`` (optional) weights the predicted positions ``1 .. L - 1``.
    """
    nll = -token_logprobs(params, config, token_ids)
    if mask is None:
        return jnp.mean(nll)
    mask = mask.astype(jnp.float32)
    return jnp.sum(nll * mask) / jnp.maximum(jnp.sum(mask), 1.0)
