"""The attention sub-layer of a decoder layer, over the paged KV cache.

Owns :func:`self_attention`: q/k/v projections (biases per config), optional q/k
RMSNorm (per head, or over the whole projection as OLMoE does), RoPE of the layer's kind
(``rope_local`` for Gemma 3's sliding layers; partial rotation per
``partial_rotary_factor``), the write of this step's K/V into the layer's pool, the
paged-attention kernel (:mod:`kvpage.model.attention`) with the layer's window,
soft-cap and score scale, and the output projection.

A sliding layer attends the last ``config.sliding_window`` positions only; the kernels
never read blocks that lie wholly before that window (the core may have freed them).
The extra kernel arguments are passed only when set, so a Llama-layout step traces
exactly what it traced before they existed.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from kvpage.kernels.host.cpu_decode_attention import cpu_paged_decode_attention
from kvpage.kernels.xla.xla_paged_attention import token_rows
from kvpage.model.attention import AttentionBackend
from kvpage.model.config import SLIDING_ATTENTION, ModelConfig
from kvpage.model.linear import linear, linears
from kvpage.model.linear_kernels import batch_invariant_enabled
from kvpage.model.norms import rms_norm
from kvpage.model.rope import apply_rope, config_rope_cos_sin, table_rope_cos_sin

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


def kernel_options(config: ModelConfig, layer_type: str, attn: dict[str, Any] | None = None
                   ) -> dict[str, Any]:
    """The attention kernel's keyword arguments for a layer of kind ``layer_type``
    (``attn``: the layer's attention params, for the sinks)."""
    options: dict[str, Any] = {}
    if config.attention_sinks and attn is not None:
        options["sinks"] = attn["sinks"].astype(jnp.float32)
    if layer_type == SLIDING_ATTENTION:
        options["sliding_window"] = config.sliding_window
    if config.attn_logit_softcap is not None:
        options["logit_soft_cap"] = config.attn_logit_softcap
    return options


def qk_norms(config: ModelConfig, attn: dict[str, Any], q: jax.Array, k: jax.Array
              ) -> tuple[jax.Array, jax.Array]:
    eps, offset = config.rms_norm_eps, config.norm_offset
    if config.qk_norm_over == "projection":  # OLMoE: over all heads' features at once
        flat_q, flat_k = q.reshape(q.shape[0], -1), k.reshape(k.shape[0], -1)
        q = rms_norm(flat_q, attn["q_norm"]["weight"], eps, offset).reshape(q.shape)
        k = rms_norm(flat_k, attn["k_norm"]["weight"], eps, offset).reshape(k.shape)
        return q, k
    return (rms_norm(q, attn["q_norm"]["weight"], eps, offset),
            rms_norm(k, attn["k_norm"]["weight"], eps, offset))


def per_token_attention(
    q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, meta: AttentionMetadata,
    sm_scale: float, otherwise: Any, options: dict[str, Any],
) -> jax.Array:
    """Batch-invariant attention (CPU): every query token is its own row of the host
    decode kernel, reading its sequence's blocks up to its own position, so its result
    depends only on its query and its context, never on the step's other rows or on
    how many tokens its own row has (a prompt scored in one chunk, a decode step, a
    speculative verify row), at every step size and with any backend. ``otherwise()``
    on other platforms."""
    kv_lens, table_rows = token_rows(
        q.shape[0], meta.kv_lens, meta.block_tables, meta.cu_q_lens, meta.num_seqs
    )
    return cpu_paged_decode_attention(
        q, k_pages, v_pages, kv_lens, meta.block_tables, sm_scale=sm_scale,
        otherwise=otherwise, table_rows=table_rows, **options)


def self_attention(
    config: ModelConfig,
    attn: dict[str, Any],
    hidden: jax.Array,
    positions: jax.Array,
    pool: KVPool,
    meta: AttentionMetadata,
    backend: AttentionBackend,
    decode_only: bool,
    layer_type: str,
) -> tuple[jax.Array, KVPool]:
    """The attention output ``[T, hidden]`` (before the residual) and the updated pool."""
    num_tokens = hidden.shape[0]
    d = config.head_dim
    q, k, v = linears(hidden, [attn["q_proj"], attn["k_proj"], attn["v_proj"]])
    q = q.reshape(num_tokens, config.num_heads, d)
    k = k.reshape(num_tokens, config.num_kv_heads, d)
    v = v.reshape(num_tokens, config.num_kv_heads, d)
    if config.qk_norm:
        q, k = qk_norms(config, attn, q, k)
    rope = config.rope_local if layer_type == SLIDING_ATTENTION else None
    # Attention scaling included; longrope / dynamic pick per sequence by its KV length.
    if batch_invariant_enabled():  # every position a key of its sequence can have
        length = meta.block_tables.shape[1] * pool[0].shape[2]
        cos, sin = table_rope_cos_sin(config, positions, length, rope)
    else:
        cos, sin = config_rope_cos_sin(config, positions, meta.cu_q_lens, meta.kv_lens, rope)
    q = apply_rope(q, cos, sin, exact=True)
    k = apply_rope(k, cos, sin, exact=True)
    k_pages, v_pages = backend.write_kv(pool[0], pool[1], k, v, meta.slot_mapping)
    scale = config.query_scale if config.query_scale is not None else d**-0.5
    options = kernel_options(config, layer_type, attn)

    def attend() -> jax.Array:
        return backend.attend(q, k_pages, v_pages, meta.kv_lens, meta.block_tables,
                              meta.cu_q_lens, meta.num_seqs, sm_scale=scale,
                              decode_only=decode_only, **options)

    if batch_invariant_enabled():
        out = per_token_attention(q, k_pages, v_pages, meta, scale, attend,
                                  options).astype(q.dtype)
    else:
        out = attend()
    out = linear(out.reshape(num_tokens, config.q_size).astype(hidden.dtype), attn["o_proj"])
    return out, (k_pages, v_pages)
