"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) as pure functions over params.

This file owns the forward pass. Nothing here holds state: :func:`forward` takes the
parameter pytree (layout in :mod:`kvpage.model.params`), the per-layer paged KV pools and
the step's attention metadata, and returns logits plus the updated pools, so params can be
swapped between steps and the whole thing can be jitted by the caller.

One call processes a ragged batch: the tokens of every sequence in the step (prefill
chunks and single decode tokens alike) are concatenated along one token axis; positions
drive RoPE, ``slot_mapping`` says where each token's K/V is written, and the paged
attention kernel (chosen by :mod:`kvpage.model.attention`) finds each token's history via
``block_tables``. Logits are produced only for the rows named by ``logits_indices``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from kvpage.model.attention import AttentionBackend
from kvpage.model.config import ModelConfig
from kvpage.model.linear_kernels import (
    embedding_rows,
    live_rows,
    matmul_nt,
)
from kvpage.model.params import Params
from kvpage.model.rope import apply_rope, config_rope_cos_sin

KVPool = tuple[jax.Array, jax.Array]
"""One layer's ``(k_pages, v_pages)``, each ``[num_kv_heads, num_blocks + 1, block_size,
head_dim]``; the last block is the scratch block padded tokens write to."""


class AttentionMetadata(NamedTuple):
    """Where this step's tokens live in the paged KV cache (device int32 arrays)."""

    slot_mapping: jax.Array  # [T]    block * block_size + offset of each token's K/V
    block_tables: jax.Array  # [S, max_blocks]
    kv_lens: jax.Array  # [S]    KV length of each row after this step (0 for padding)
    cu_q_lens: jax.Array  # [S + 1]
    num_seqs: jax.Array  # [1]    rows >= num_seqs are padding


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, statistics in float32, result in ``x``'s dtype."""
    xf = x.astype(jnp.float32)
    scale = jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return weight * (xf * scale).astype(x.dtype)


def linear(x: jax.Array, layer: dict[str, jax.Array]) -> jax.Array:
    """``x @ weight.T (+ bias)`` with an HF-oriented ``[out, in]`` weight."""
    y = matmul_nt(x, layer["weight"])
    if "bias" in layer:
        y = y + layer["bias"]
    return y.astype(x.dtype)


def layer_params(params: Params, index: int) -> dict[str, Any]:
    """Layer ``index``'s sub-tree, for both the list and the stacked layout."""
    layers = params["layers"]
    if isinstance(layers, Sequence):
        return layers[index]
    return jax.tree_util.tree_map(lambda leaf: leaf[index], layers)


def _attention_block(
    config: ModelConfig,
    attn: dict[str, Any],
    hidden: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    pool: KVPool,
    meta: AttentionMetadata,
    backend: AttentionBackend,
    decode_only: bool,
) -> tuple[jax.Array, KVPool]:
    num_tokens = hidden.shape[0]
    d = config.head_dim
    q = linear(hidden, attn["q_proj"]).reshape(num_tokens, config.num_heads, d)
    k = linear(hidden, attn["k_proj"]).reshape(num_tokens, config.num_kv_heads, d)
    v = linear(hidden, attn["v_proj"]).reshape(num_tokens, config.num_kv_heads, d)
    if config.qk_norm:
        q = rms_norm(q, attn["q_norm"]["weight"], config.rms_norm_eps)
        k = rms_norm(k, attn["k_norm"]["weight"], config.rms_norm_eps)
    q = apply_rope(q, cos, sin)
    k = apply_rope(k, cos, sin)
    k_pages, v_pages = backend.write_kv(pool[0], pool[1], k, v, meta.slot_mapping)
    out = backend.attend(
        q,
        k_pages,
        v_pages,
        meta.kv_lens,
        meta.block_tables,
        meta.cu_q_lens,
        meta.num_seqs,
        sm_scale=d**-0.5,
        decode_only=decode_only,
    )
    out = linear(out.reshape(num_tokens, config.q_size).astype(hidden.dtype), attn["o_proj"])
    return out, (k_pages, v_pages)


def _mlp(mlp: dict[str, Any], hidden: jax.Array) -> jax.Array:
    gate = linear(hidden, mlp["gate_proj"])
    up = linear(hidden, mlp["up_proj"])
    return linear(jax.nn.silu(gate) * up, mlp["down_proj"])


def embed_tokens(params: Params, token_ids: jax.Array) -> jax.Array:
    """The input embeddings ``[T, hidden]`` of ``token_ids``."""
    return embedding_rows(params["embed_tokens"]["weight"], token_ids)


def decoder_layer(
    config: ModelConfig,
    layer: dict[str, Any],
    hidden: jax.Array,
    positions: jax.Array,
    pool: KVPool,
    meta: AttentionMetadata,
    backend: AttentionBackend,
    decode_only: bool = False,
) -> tuple[jax.Array, KVPool]:
    """One decoder layer: attention (writing this step's K/V into ``pool``) then the MLP,
    each with its residual. Every layer of a model has the same shapes, so the model
    runner compiles this once and calls it per layer (compile time independent of depth)."""
    eps = config.rms_norm_eps
    # Attention scaling included; longrope / dynamic pick per sequence by its KV length.
    cos, sin = config_rope_cos_sin(config, positions, meta.cu_q_lens, meta.kv_lens)

    # Tokens past cu_q_lens[num_seqs] are padding (their rows' outputs are never read).
    with live_rows(hidden.shape[0], meta.cu_q_lens[meta.num_seqs[0]]):
        normed = rms_norm(hidden, layer["input_layernorm"]["weight"], eps)
        attn_out, new_pool = _attention_block(
            config, layer["self_attn"], normed, cos, sin, pool, meta, backend, decode_only
        )
        residual = hidden + attn_out
        normed = rms_norm(residual, layer["post_attention_layernorm"]["weight"], eps)
        return residual + _mlp(layer["mlp"], normed), new_pool


def decoder_hidden_states(
    params: Params,
    config: ModelConfig,
    token_ids: jax.Array,
    positions: jax.Array,
    kv_pools: Sequence[KVPool],
    meta: AttentionMetadata,
    backend: AttentionBackend,
    decode_only: bool = False,
) -> tuple[jax.Array, list[KVPool]]:
    """Last-layer hidden states ``[T, hidden]`` (before the final norm) and updated pools,
    with every layer traced in one function (the reference composition; the runner calls
    :func:`decoder_layer` per layer instead).

    ``decode_only`` promises every live sequence has exactly one new token (lets the
    attention backend pick a decode kernel).
    """
    if len(kv_pools) != config.num_layers:
        raise ValueError(f"expected {config.num_layers} KV pools, got {len(kv_pools)}")
    hidden = embed_tokens(params, token_ids)
    new_pools: list[KVPool] = []
    for i in range(config.num_layers):
        hidden, pool = decoder_layer(
            config, layer_params(params, i), hidden, positions, kv_pools[i], meta, backend,
            decode_only,
        )
        new_pools.append(pool)
    return hidden, new_pools


def compute_logits(params: Params, config: ModelConfig, hidden: jax.Array) -> jax.Array:
    """float32 logits ``[N, vocab]`` of (un-normed) last-layer hidden states ``[N, hidden]``."""
    normed = rms_norm(hidden, params["norm"]["weight"], config.rms_norm_eps)
    head = (
        params["embed_tokens"]["weight"]
        if config.tie_word_embeddings
        else params["lm_head"]["weight"]
    )
    return matmul_nt(normed, head, preferred_element_type=jnp.float32)


def forward(
    params: Params,
    config: ModelConfig,
    token_ids: jax.Array,
    positions: jax.Array,
    kv_pools: Sequence[KVPool],
    meta: AttentionMetadata,
    logits_indices: jax.Array,
    backend: AttentionBackend,
    decode_only: bool = False,
) -> tuple[jax.Array, list[KVPool]]:
    """One model step: write this step's K/V, attend, and return logits at ``logits_indices``.

    Returns ``(logits [len(logits_indices), vocab] float32, new per-layer pools)``.
    """
    hidden, new_pools = decoder_hidden_states(
        params, config, token_ids, positions, kv_pools, meta, backend, decode_only
    )
    logits = compute_logits(params, config, jnp.take(hidden, logits_indices, axis=0))
    return logits, new_pools
