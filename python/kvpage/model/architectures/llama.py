"""The dense Llama family: Llama, Mistral, Qwen2, Qwen3 (the layout every other file varies).

Pre-norm decoder layers of GQA attention with RoPE and a SwiGLU MLP. Qwen2 has q/k/v
biases; Qwen3 RMS-normalises each query and key head; Mistral and Qwen2/3 may slide a
window over every layer (Qwen only with ``use_sliding_window``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpage.model.architectures.architecture import Architecture, ConfigFields
from kvpage.model.config_types import SLIDING_ATTENTION
from kvpage.model.hf_config import activation, decoder_fields, sliding_window


def llama_fields(raw: Mapping[str, Any], *, qkv_bias: bool = False, qk_norm: bool = False,
                 window: int | None = None) -> ConfigFields:
    """The dense-family fields, with a window (``window``) slid over every layer."""
    activation(raw)
    fields = decoder_fields(raw)
    attention_bias = bool(raw.get("attention_bias", False))
    fields.update(
        qkv_bias=attention_bias or qkv_bias,
        o_proj_bias=attention_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=qk_norm,
    )
    if window is not None:
        fields.update(sliding_window=window,
                      layer_types=(SLIDING_ATTENTION,) * fields["num_layers"])
    return fields


def _qwen_window(raw: Mapping[str, Any]) -> int | None:
    return sliding_window(raw) if raw.get("use_sliding_window", False) else None


def _qwen2(raw: Mapping[str, Any]) -> ConfigFields:
    fields = llama_fields(raw, window=_qwen_window(raw))
    fields.update(qkv_bias=True, o_proj_bias=False)
    return fields


LLAMA = Architecture(
    "LlamaForCausalLM", "llama", lambda raw: llama_fields(raw),
    gguf_names=("llama",), gguf_qk_permuted=True,
)
MISTRAL = Architecture(
    "MistralForCausalLM", "mistral", lambda raw: llama_fields(raw, window=sliding_window(raw)),
)
QWEN2 = Architecture("Qwen2ForCausalLM", "qwen2", _qwen2, gguf_names=("qwen2",))
QWEN3 = Architecture(
    "Qwen3ForCausalLM", "qwen3",
    lambda raw: llama_fields(raw, qk_norm=True, window=_qwen_window(raw)),
    gguf_names=("qwen3",),
)
