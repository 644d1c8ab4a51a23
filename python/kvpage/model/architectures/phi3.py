"""Phi-3 and Phi-4 (mini): the Llama layout with fused projections.

The checkpoint fuses the q/k/v projections into ``qkv_proj`` (rows: queries, keys,
values) and the gate/up projections into ``gate_up_proj`` (rows: gate, then up); kvpage
keeps them apart, reading row ranges. RoPE may be ``longrope`` and may rotate only a
fraction of each head (Phi-4-mini's ``partial_rotary_factor`` 0.75); a ``sliding_window``
applies to every layer.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpage.model.architectures.architecture import Architecture, ConfigFields
from kvpage.model.architectures.llama import llama_fields
from kvpage.model.hf_config import partial_rotary_factor, sliding_window


def _phi3(raw: Mapping[str, Any]) -> ConfigFields:
    fields = llama_fields(raw, window=sliding_window(raw))
    fields["partial_rotary_factor"] = partial_rotary_factor(raw)
    return fields


def _q(config: Any) -> tuple[int, int]:
    return 0, config.q_size


def _k(config: Any) -> tuple[int, int]:
    return config.q_size, config.q_size + config.kv_size


def _v(config: Any) -> tuple[int, int]:
    return config.q_size + config.kv_size, config.q_size + 2 * config.kv_size


def _gate(config: Any) -> tuple[int, int]:
    return 0, config.intermediate_size


def _up(config: Any) -> tuple[int, int]:
    return config.intermediate_size, 2 * config.intermediate_size


PHI3 = Architecture(
    "Phi3ForCausalLM", "phi3", _phi3,
    fused={
        "self_attn.q_proj.weight": ("self_attn.qkv_proj.weight", _q),
        "self_attn.k_proj.weight": ("self_attn.qkv_proj.weight", _k),
        "self_attn.v_proj.weight": ("self_attn.qkv_proj.weight", _v),
        "mlp.gate_proj.weight": ("mlp.gate_up_proj.weight", _gate),
        "mlp.up_proj.weight": ("mlp.gate_up_proj.weight", _up),
    },
    gguf_names=("phi3",),
    gguf_fused={
        "attn_qkv": (("self_attn.q_proj", _q), ("self_attn.k_proj", _k), ("self_attn.v_proj", _v)),
        "ffn_up": (("mlp.gate_proj", _gate), ("mlp.up_proj", _up)),
    },
)
