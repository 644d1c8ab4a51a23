"""Gemma, Gemma 2 and Gemma 3 (text): the Llama layout with Gemma's habits.

All: RMSNorm scaling by ``1 + weight`` (computed in float32), a GeGLU MLP (tanh GELU),
embeddings multiplied by ``sqrt(hidden_size)``, tied embeddings. Gemma 2 and 3 add a
norm after both attention and MLP ("sandwich"), queries scaled by
``query_pre_attn_scalar ** -0.5``, and sliding-window layers alternating with full ones
(``layer_types``).
Gemma 2 soft-caps attention scores and final logits; Gemma 3 instead RMS-normalises
each query and key head and gives its sliding layers their own RoPE base.
llama.cpp's converter stores Gemma norm weights with the 1 already added.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from kvpage.model.architectures.architecture import Architecture, ConfigFields, GGUFGet
from kvpage.model.config_types import FULL_ATTENTION, SLIDING_ATTENTION, RopeConfig
from kvpage.model.gguf_file import GGUFArray
from kvpage.model.hf_config import (
    activation,
    decoder_fields,
    layer_types,
    local_rope_config,
    optional_float,
    sliding_window,
)

_GELU = ("gelu_pytorch_tanh", "gelu_tanh", "gelu")


def _gemma1(raw: Mapping[str, Any]) -> ConfigFields:
    act = activation(raw, _GELU)
    del act  # every Gemma MLP is the tanh GELU (transformers maps "gelu" to it too)
    fields = decoder_fields(raw)
    if "tie_word_embeddings" not in raw:
        fields["tie_word_embeddings"] = True
    fields.update(
        hidden_act="gelu_tanh",
        norm_offset=1.0,
        embedding_multiplier=math.sqrt(fields["hidden_size"]),
        qkv_bias=bool(raw.get("attention_bias", False)),
        o_proj_bias=bool(raw.get("attention_bias", False)),
    )
    return fields


def _gemma_fields(raw: Mapping[str, Any], pattern: int) -> ConfigFields:
    act = activation(raw, _GELU)
    if act == "gelu":  # transformers' Gemma maps the legacy "gelu" to the tanh GELU too
        act = "gelu_pytorch_tanh"
    fields = decoder_fields(raw)
    if "tie_word_embeddings" not in raw:
        fields["tie_word_embeddings"] = True
    if raw.get("use_bidirectional_attention"):
        raise ValueError("bidirectional (encoder) Gemma attention is not supported")
    fields.update(
        hidden_act="gelu_tanh",
        norm_offset=1.0,
        sandwich_norms=True,
        embedding_multiplier=math.sqrt(fields["hidden_size"]),
        query_scale=float(raw.get("query_pre_attn_scalar", fields["head_dim"])) ** -0.5,
        qkv_bias=bool(raw.get("attention_bias", False)),
        o_proj_bias=bool(raw.get("attention_bias", False)),
        layer_types=layer_types(raw, fields["num_layers"], pattern),
        sliding_window=sliding_window(raw),
    )
    return fields


def _gemma2(raw: Mapping[str, Any]) -> ConfigFields:
    fields = _gemma_fields(raw, pattern=2)
    fields.update(
        attn_logit_softcap=optional_float(raw.get("attn_logit_softcapping", 50.0)),
        final_logit_softcap=optional_float(raw.get("final_logit_softcapping", 30.0)),
    )
    return fields


def _gemma3(raw: Mapping[str, Any]) -> ConfigFields:
    fields = _gemma_fields(raw, pattern=int(raw.get("sliding_window_pattern", 6)))
    fields.update(
        qk_norm=True,
        rope_local=local_rope_config(raw),
        attn_logit_softcap=optional_float(raw.get("attn_logit_softcapping")),
        final_logit_softcap=optional_float(raw.get("final_logit_softcapping")),
    )
    return fields


def _gguf_gemma(version: int) -> Any:
    """The ``gguf_parse`` of a Gemma file. llama.cpp reads the window pattern and the
    local RoPE base when written and otherwise hard-codes them (every 2nd / 6th layer
    full; Gemma 3's local base 10000, Gemma 2's the global one), and the
    query scale ``head_dim ** -0.5`` except for the 27B models (46 / 62 layers), which
    scale by ``(hidden / heads) ** -0.5`` as their ``query_pre_attn_scalar`` says."""

    def parse(get: GGUFGet, fields: ConfigFields) -> ConfigFields:
        n, hidden = fields["num_layers"], fields["hidden_size"]
        # llama.cpp's load_swa_pattern: one bool per layer (true: sliding) or a period
        # (every period-th layer full, 0: none), default 2 (Gemma 2) / 6 (Gemma 3).
        pattern = get("attention.sliding_window_pattern", None)
        if isinstance(pattern, GGUFArray):
            flags = [bool(f) for f in pattern.tolist()] if len(pattern) == n else None
            if flags is None:
                raise ValueError(f"attention.sliding_window_pattern has {len(pattern)} "
                                 f"entries for {n} layers")
        else:
            period = int(pattern) if pattern is not None else (2 if version == 2 else 6)
            flags = [period == 0 or i % period < period - 1 for i in range(n)]
        big = n == (46 if version == 2 else 62)
        out: ConfigFields = dict(
            hidden_act="gelu_tanh",
            norm_offset=1.0,
            sandwich_norms=True,
            embedding_multiplier=math.sqrt(hidden),
            query_scale=(hidden / fields["num_heads"]) ** -0.5 if big else None,
            sliding_window=get("attention.sliding_window", None),
            final_logit_softcap=optional_float(get("final_logit_softcapping", None)),
            attn_logit_softcap=optional_float(get("attn_logit_softcapping", None)),
        )
        if out["sliding_window"]:
            out["layer_types"] = tuple(SLIDING_ATTENTION if f else FULL_ATTENTION
                                       for f in flags)
        # The sliding layers' RoPE base: rope.freq_base_swa when written (the converter
        # writes Gemma 3's rope_parameters["sliding_attention"]["rope_theta"]), else
        # Gemma 3's 10000 / Gemma 2's global base; never frequency-scaled.
        local_base = get("rope.freq_base_swa", None)
        if local_base is not None:
            out["rope_local"] = RopeConfig(theta=float(local_base))
        elif version == 3:
            out["rope_local"] = RopeConfig(theta=10000.0)
        return out

    return parse


_GEMMA_GGUF = {
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}

def _gguf_gemma1(get: GGUFGet, fields: ConfigFields) -> ConfigFields:
    return dict(hidden_act="gelu_tanh", norm_offset=1.0,
                embedding_multiplier=math.sqrt(fields["hidden_size"]))


GEMMA = Architecture("GemmaForCausalLM", "gemma", _gemma1, gguf_names=("gemma",),
                     gguf_parse=_gguf_gemma1)
GEMMA2 = Architecture("Gemma2ForCausalLM", "gemma2", _gemma2, gguf_names=("gemma2",),
                      gguf_tensors=_GEMMA_GGUF, gguf_parse=_gguf_gemma(2))
GEMMA3 = Architecture("Gemma3ForCausalLM", "gemma3_text", _gemma3, gguf_names=("gemma3",),
                      gguf_tensors=_GEMMA_GGUF, gguf_parse=_gguf_gemma(3))
