"""The sparse mixture-of-experts members of the Llama family: Qwen3-MoE, Qwen2-MoE,
Mixtral and OLMoE.

Each is the dense layout of :mod:`.llama` with its MLP replaced by a routed block
(:class:`~kvpage.model.config_types.MoEConfig`): softmax over the experts then top-k,
renormalised (Mixtral always, the others per ``norm_topk_prob``). Qwen2-MoE adds a
sigmoid-gated shared expert; OLMoE RMS-normalises the whole q and k projections; Mixtral
names its block ``block_sparse_moe`` with experts ``w1``/``w3``/``w2``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpage.model.architectures.architecture import Architecture, ConfigFields, GGUFGet
from kvpage.model.architectures.llama import llama_fields
from kvpage.model.config_types import MoEConfig
from kvpage.model.hf_config import sliding_window


def _experts(raw: Mapping[str, Any]) -> int:
    value = raw.get("num_experts", raw.get("num_local_experts"))
    if value is None:
        raise ValueError("MoE config lacks num_experts / num_local_experts")
    return int(value)


def _dense_layers(raw: Mapping[str, Any], num_layers: int) -> tuple[int, ...]:
    """Qwen's ``mlp_only_layers`` plus the layers ``decoder_sparse_step`` skips."""
    only = {int(i) for i in raw.get("mlp_only_layers") or ()}
    step = int(raw.get("decoder_sparse_step") or 1)
    return tuple(i for i in range(num_layers) if i in only or (i + 1) % step)


def _qwen_moe(raw: Mapping[str, Any], *, qk_norm: bool, shared: bool) -> ConfigFields:
    window = sliding_window(raw) if raw.get("use_sliding_window", False) else None
    fields = llama_fields(raw, qk_norm=qk_norm, window=window)
    if shared:
        fields.update(qkv_bias=True, o_proj_bias=False)
    fields["moe"] = MoEConfig(
        num_experts=_experts(raw),
        top_k=int(raw["num_experts_per_tok"]),
        intermediate_size=int(raw["moe_intermediate_size"]),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=int(raw.get("shared_expert_intermediate_size") or 0)
        if shared else 0,
        shared_expert_gate=shared,
        dense_layers=_dense_layers(raw, fields["num_layers"]),
    )
    return fields


def _mixtral(raw: Mapping[str, Any]) -> ConfigFields:
    fields = llama_fields(raw, window=sliding_window(raw))
    fields["moe"] = MoEConfig(
        num_experts=_experts(raw),
        top_k=int(raw["num_experts_per_tok"]),
        intermediate_size=fields["intermediate_size"],
        norm_topk_prob=True,
    )
    return fields


def _olmoe(raw: Mapping[str, Any]) -> ConfigFields:
    if raw.get("clip_qkv") is not None:
        raise ValueError("OLMoE clip_qkv is not supported")
    fields = llama_fields(raw, qk_norm=True)
    fields["qk_norm_over"] = "projection"
    fields["moe"] = MoEConfig(
        num_experts=_experts(raw),
        top_k=int(raw["num_experts_per_tok"]),
        intermediate_size=fields["intermediate_size"],
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
    )
    return fields


def _gguf_moe(norm_topk_prob: bool, shared: bool = False) -> Any:
    """The ``gguf_parse`` of a MoE file: llama.cpp's expert keys; the router's
    renormalisation is the architecture's (``expert_weights_norm`` when written)."""

    def parse(get: GGUFGet, fields: ConfigFields) -> ConfigFields:
        return {"moe": MoEConfig(
            num_experts=int(get("expert_count", 0)),
            top_k=int(get("expert_used_count", 0)),
            intermediate_size=int(get("expert_feed_forward_length",
                                      fields["intermediate_size"])),
            norm_topk_prob=bool(get("expert_weights_norm", norm_topk_prob)),
            shared_expert_intermediate_size=int(get("expert_shared_feed_forward_length", 0))
            if shared else 0,
            shared_expert_gate=shared,
        )}

    return parse


_GGUF_EXPERTS = {
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": "mlp.experts.gate_proj",
    "ffn_up_exps": "mlp.experts.up_proj",
    "ffn_down_exps": "mlp.experts.down_proj",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}

QWEN3_MOE = Architecture(
    "Qwen3MoeForCausalLM", "qwen3_moe", lambda raw: _qwen_moe(raw, qk_norm=True, shared=False),
    gguf_names=("qwen3moe",), gguf_tensors=_GGUF_EXPERTS, gguf_parse=_gguf_moe(True),
)
QWEN2_MOE = Architecture(
    "Qwen2MoeForCausalLM", "qwen2_moe", lambda raw: _qwen_moe(raw, qk_norm=False, shared=True),
    gguf_names=("qwen2moe",), gguf_tensors=_GGUF_EXPERTS,
    gguf_parse=_gguf_moe(False, shared=True),
)
MIXTRAL = Architecture(
    "MixtralForCausalLM", "mixtral", _mixtral,
    renames=(
        (r"\.mlp\.gate\.", ".block_sparse_moe.gate."),
        (r"\.mlp\.experts\.(\d+)\.gate_proj\.", r".block_sparse_moe.experts.\1.w1."),
        (r"\.mlp\.experts\.(\d+)\.up_proj\.", r".block_sparse_moe.experts.\1.w3."),
        (r"\.mlp\.experts\.(\d+)\.down_proj\.", r".block_sparse_moe.experts.\1.w2."),
    ),
    gguf_names=("llama",), gguf_qk_permuted=True, gguf_experts=True,
    gguf_tensors=_GGUF_EXPERTS, gguf_parse=_gguf_moe(True),
)
OLMOE = Architecture("OlmoeForCausalLM", "olmoe", _olmoe, gguf_names=("olmoe",),
                     gguf_tensors=_GGUF_EXPERTS, gguf_parse=_gguf_moe(False))
