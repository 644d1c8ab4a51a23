"""gpt-oss: attention sinks, alternating sliding / full layers, and biased experts.

The Llama layout with q/k/v/o biases, a learned sink logit per query head in every
attention softmax (``self_attn.sinks``), sliding-window layers (``layer_types``)
alternating with full ones, YaRN RoPE, and a MoE block whose router has a bias and
takes the top-k logits before the softmax; each expert has biases and a clamped SwiGLU
(:class:`~kvpage.model.config_types.MoEConfig`). The checkpoint keeps each layer's experts
as ``experts.gate_up_proj [E, hidden, 2 * I]`` (gate and up interleaved by column,
``[in, out]`` orientation), ``gate_up_proj_bias [E, 2 * I]``, ``down_proj [E, I,
hidden]`` and ``down_proj_bias``; kvpage reads them into its ``[E, out, in]`` stacks.
The released checkpoints store the experts as MXFP4 (``*_blocks`` ``[E, out, in / 32,
16]`` uint8 pairs of 4-bit floats, ``*_scales`` ``[E, out, in / 32]`` power-of-two
exponents biased by 127, rows of ``gate_up`` interleaved the same way): kvpage
dequantizes them at load (to the model's dtype; the 4-bit blocks are not kept yet).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from kvpage.model.architectures.architecture import Architecture, ConfigFields, TensorSource
from kvpage.model.architectures.llama import llama_fields
from kvpage.model.config_types import MoEConfig
from kvpage.model.hf_config import layer_types, sliding_window


def _gpt_oss(raw: Mapping[str, Any]) -> ConfigFields:
    fields = llama_fields(raw)
    fields.update(
        qkv_bias=True,
        o_proj_bias=True,
        attention_sinks=True,
        sliding_window=sliding_window(raw),
        layer_types=layer_types(raw, fields["num_layers"], pattern=2),
        moe=MoEConfig(
            num_experts=int(raw["num_local_experts"]),
            top_k=int(raw["num_experts_per_tok"]),
            intermediate_size=fields["intermediate_size"],
            router="topk_softmax",
            router_bias=True,
            expert_bias=True,
            swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
            swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        ),
    )
    return fields


FP4_VALUES = np.array(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
"""The 16 values of an MXFP4 (E2M1) code."""


def dequantize_mxfp4(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 ``[..., out, in]`` of MXFP4 ``blocks [..., out, in / 32, 16]`` (low nibble
    first) and ``scales [..., out, in / 32]`` (exponents biased by 127)."""
    blocks = blocks.astype(np.uint8)
    values = np.stack([FP4_VALUES[blocks & 0x0F], FP4_VALUES[blocks >> 4]], axis=-1)
    values = values.reshape(*blocks.shape[:-1], 32)
    values = np.ldexp(values, scales.astype(np.int32)[..., None] - 127)
    return values.reshape(*blocks.shape[:-2], -1)


def _half(name: str, offset: int, transpose: bool) -> Any:
    """Every other column (``offset`` 0: gate, 1: up) of a fused interleaved tensor;
    for the weights, MXFP4 storage when the float tensor is absent (its rows interleave)."""

    def take(value: np.ndarray) -> np.ndarray:
        part = value[..., offset::2]
        return np.swapaxes(part, 1, 2) if transpose else part

    def rows(value: np.ndarray) -> np.ndarray:
        return value[:, offset::2, :]

    packed = TensorSource((f"{name}_blocks", f"{name}_scales"), combine=dequantize_mxfp4,
                          transform=rows)
    return lambda config: TensorSource((name,), transform=take,
                                       otherwise=packed if transpose else None)


def _transposed(name: str) -> Any:
    packed = TensorSource((f"{name}_blocks", f"{name}_scales"), combine=dequantize_mxfp4)
    return lambda config: TensorSource((name,), transform=lambda v: np.swapaxes(v, 1, 2),
                                       otherwise=packed)


def _plain(name: str) -> Any:
    return lambda config: TensorSource((name,))


GPT_OSS = Architecture(
    "GptOssForCausalLM", "gpt_oss", _gpt_oss,
    sources={
        "mlp.gate.weight": _plain("mlp.router.weight"),
        "mlp.gate.bias": _plain("mlp.router.bias"),
        "mlp.experts.gate_proj.weight": _half("mlp.experts.gate_up_proj", 0, True),
        "mlp.experts.up_proj.weight": _half("mlp.experts.gate_up_proj", 1, True),
        "mlp.experts.down_proj.weight": _transposed("mlp.experts.down_proj"),
        "mlp.experts.gate_proj.bias": _half("mlp.experts.gate_up_proj_bias", 0, False),
        "mlp.experts.up_proj.bias": _half("mlp.experts.gate_up_proj_bias", 1, False),
        "mlp.experts.down_proj.bias": _plain("mlp.experts.down_proj_bias"),
    },
)
