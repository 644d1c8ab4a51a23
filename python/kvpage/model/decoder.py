"""The decoder: every supported architecture's forward pass, as pure functions over params.

This file owns the composition of a decoder layer from the shared blocks -- the
attention sub-layer (:mod:`kvpage.model.self_attention`), the dense gated MLP
(:mod:`kvpage.model.mlp`) or the mixture of experts (:mod:`kvpage.model.moe`), RMSNorm
(:mod:`kvpage.model.norms`) -- as the :class:`~kvpage.model.config.ModelConfig` fields
say (the architectures declare those fields: :mod:`kvpage.model.architectures`)::

    x = embed(tokens) * embedding_multiplier?
    per layer:  a = attention(norm(x))            ; a = post_attention_norm(a)   [sandwich]
                x = x + a
                m = mlp_or_moe(norm'(x))          ; m = post_feedforward_norm(m) [sandwich]
                x = x + m
    logits = softcap?(lm_head(norm(x)))

where ``norm'`` is ``pre_feedforward_layernorm`` with sandwich norms and
``post_attention_layernorm`` without (the Llama layout's name for the pre-MLP norm).

Nothing here holds state: :func:`forward` takes the parameter pytree (layout in
:mod:`kvpage.model.params`), the per-layer paged KV pools and the step's attention
metadata, and returns logits plus the updated pools, so params can be swapped between
steps and the whole thing can be jitted by the caller.

One call processes a ragged batch: the tokens of every sequence in the step (prefill
chunks and single decode tokens alike) are concatenated along one token axis; positions
drive RoPE, ``slot_mapping`` says where each token's K/V is written, and the paged
attention kernel (chosen by :mod:`kvpage.model.attention`) finds each token's history via
``block_tables``. Logits are produced only for the rows named by ``logits_indices``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp

from kvpage.model.attention import AttentionBackend
from kvpage.model.config import FULL_ATTENTION, ModelConfig
from kvpage.model.linear import linear
from kvpage.model.linear_kernels import embedding_rows, live_rows, matmul_nt
from kvpage.model.mlp import gated_mlp
from kvpage.model.moe import moe_block
from kvpage.model.norms import rms_norm
from kvpage.model.params import Params
from kvpage.model.self_attention import AttentionMetadata, KVPool, self_attention

__all__ = [
    "AttentionMetadata",
    "KVPool",
    "compute_logits",
    "decoder_hidden_states",
    "decoder_layer",
    "embed_tokens",
    "feed_forward",
    "forward",
    "layer_params",
    "linear",
    "rms_norm",
]


def layer_params(params: Params, index: int) -> dict[str, Any]:
    """Layer ``index``'s sub-tree, for both the list and the stacked layout."""
    layers = params["layers"]
    if isinstance(layers, Sequence):
        return layers[index]
    return jax.tree_util.tree_map(lambda leaf: leaf[index], layers)


def feed_forward(config: ModelConfig, mlp: dict[str, Any], x: jax.Array) -> jax.Array:
    """The layer's feed-forward block: the mixture of experts when its params have
    experts, else the dense gated MLP."""
    if "experts" in mlp:
        return moe_block(config, mlp, x)
    return gated_mlp(mlp, x, config.hidden_act)


def embed_tokens(params: Params, token_ids: jax.Array, config: ModelConfig | None = None
                 ) -> jax.Array:
    """The input embeddings ``[T, hidden]`` of ``token_ids`` (times the config's
    ``embedding_multiplier``, in the embeddings' dtype, as Gemma does)."""
    rows = embedding_rows(params["embed_tokens"]["weight"], token_ids)
    if config is not None and config.embedding_multiplier is not None:
        rows = rows * jnp.asarray(config.embedding_multiplier, rows.dtype)
    return rows


def decoder_layer(
    config: ModelConfig,
    layer: dict[str, Any],
    hidden: jax.Array,
    positions: jax.Array,
    pool: KVPool,
    meta: AttentionMetadata,
    backend: AttentionBackend,
    decode_only: bool = False,
    layer_type: str = FULL_ATTENTION,
) -> tuple[jax.Array, KVPool]:
    """One decoder layer of kind ``layer_type``: attention (writing this step's K/V into
    ``pool``) then the MLP or MoE, each with its residual. Layers of one kind and
    structure have the same shapes, so the model runner compiles one group of them once
    and calls it per group (compile time independent of depth)."""
    eps, offset = config.rms_norm_eps, config.norm_offset

    def norm(x: jax.Array, name: str) -> jax.Array:
        return rms_norm(x, layer[name]["weight"], eps, offset)

    # Tokens past cu_q_lens[num_seqs] are padding (their rows' outputs are never read).
    with live_rows(hidden.shape[0], meta.cu_q_lens[meta.num_seqs[0]]):
        attn_out, new_pool = self_attention(
            config, layer["self_attn"], norm(hidden, "input_layernorm"), positions, pool,
            meta, backend, decode_only, layer_type,
        )
        if config.sandwich_norms:
            attn_out = norm(attn_out, "post_attention_layernorm")
            residual = hidden + attn_out
            out = feed_forward(config, layer["mlp"], norm(residual, "pre_feedforward_layernorm"))
            return residual + norm(out, "post_feedforward_layernorm"), new_pool
        residual = hidden + attn_out
        out = feed_forward(config, layer["mlp"], norm(residual, "post_attention_layernorm"))
        return residual + out, new_pool


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
    hidden = embed_tokens(params, token_ids, config)
    new_pools: list[KVPool] = []
    for i in range(config.num_layers):
        hidden, pool = decoder_layer(
            config, layer_params(params, i), hidden, positions, kv_pools[i], meta, backend,
            decode_only, config.layer_type(i),
        )
        new_pools.append(pool)
    return hidden, new_pools


def compute_logits(params: Params, config: ModelConfig, hidden: jax.Array) -> jax.Array:
    """float32 logits ``[N, vocab]`` of (un-normed) last-layer hidden states ``[N, hidden]``."""
    normed = rms_norm(hidden, params["norm"]["weight"], config.rms_norm_eps, config.norm_offset)
    head = (
        params["embed_tokens"]["weight"]
        if config.tie_word_embeddings
        else params["lm_head"]["weight"]
    )
    logits = matmul_nt(normed, head, preferred_element_type=jnp.float32)
    cap = config.final_logit_softcap
    if cap is not None:
        logits = jnp.tanh(logits / cap) * cap
    return logits


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
