"""Writing tiny GGUF files for the GGUF loader tests, the way llama.cpp's converter does.

:func:`write_gguf` takes a tiny HF transformers model (from :mod:`model_fixtures`),
renames its tensors to GGUF names, permutes Llama's q/k rows as llama.cpp does,
quantizes the tensors asked for with ``gguf.quants.quantize`` and writes the model
metadata plus a small byte-level BPE tokenizer with a chat template.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he"]
# 256 byte tokens, the merged tokens, then the special tokens.
TOKENIZER_VOCAB = 256 + len(MERGES) + len(SPECIAL_TOKENS)
BOS_ID, EOS_ID = 256 + len(MERGES) + 1, 256 + len(MERGES) + 2

_HF_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
_LAYER = {
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


# llama.cpp's names for the other architectures' tensors (gemma: its own norms).
_LAYER_MOE = {
    "mlp.gate": "ffn_gate_inp",
    "mlp.experts.gate_proj": "ffn_gate_exps",
    "mlp.experts.up_proj": "ffn_up_exps",
    "mlp.experts.down_proj": "ffn_down_exps",
    "mlp.shared_expert.gate_proj": "ffn_gate_shexp",
    "mlp.shared_expert.up_proj": "ffn_up_shexp",
    "mlp.shared_expert.down_proj": "ffn_down_shexp",
    "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
    "self_attn.qkv_proj": "attn_qkv",
    "mlp.gate_up_proj": "ffn_up",
}
_LAYER_GEMMA = {
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}
MOE_ARCHS = ("qwen3moe", "qwen2moe", "olmoe", "mixtral")


def gguf_name(hf_name: str, arch: str = "llama") -> str:
    if hf_name in _HF_TO_GGUF:
        return _HF_TO_GGUF[hf_name]
    parts = hf_name.removeprefix("model.layers.").split(".")
    layer, module, kind = parts[0], ".".join(parts[1:-1]), parts[-1]
    table = {**_LAYER, **_LAYER_MOE, **(_LAYER_GEMMA if arch in ("gemma2", "gemma3") else {})}
    return f"blk.{layer}.{table[module]}.{kind}"


def _llama_cpp_tensors(state: dict[str, np.ndarray], arch: str) -> dict[str, np.ndarray]:
    """transformers' in-memory tensors as llama.cpp's converter writes them: fused
    experts ``gate_up_proj [E, 2I, H]`` split into the stacked gate / up experts, Gemma
    norm weights with their 1 added."""
    out: dict[str, np.ndarray] = {}
    for name, value in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            half = value.shape[1] // 2
            out[name.replace("gate_up_proj", "gate_proj.weight")] = value[:, :half]
            out[name.replace("gate_up_proj", "up_proj.weight")] = value[:, half:]
        elif name.endswith("mlp.experts.down_proj"):
            out[name + ".weight"] = value
        elif arch.startswith("gemma") and name.endswith("norm.weight"):
            out[name] = value + 1.0
        else:
            out[name] = value
    return out


def _arch_metadata(writer: Any, cfg: Any, arch: str) -> None:
    """The architecture keys llama.cpp's converter writes for MoE / Gemma / Phi-3."""
    if arch in MOE_ARCHS:
        experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
        writer.add_expert_count(experts)
        writer.add_expert_used_count(cfg.num_experts_per_tok)
        width = getattr(cfg, "moe_intermediate_size", None)
        if width:
            writer.add_expert_feed_forward_length(width)
        shared = getattr(cfg, "shared_expert_intermediate_size", 0)
        if shared:
            writer.add_expert_shared_feed_forward_length(shared)
    if arch.startswith("gemma"):
        if getattr(cfg, "sliding_window", None):
            writer.add_sliding_window(cfg.sliding_window)
        local = (getattr(cfg, "rope_parameters", None) or {}).get("sliding_attention")
        if arch == "gemma3" and local:  # what the converter writes for the local layers
            writer.add_float32("gemma3.rope.freq_base_swa", float(local["rope_theta"]))
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            if getattr(cfg, key, None) is not None:
                getattr(writer, f"add_{key}")(float(getattr(cfg, key)))


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's ``LlamaModel.permute``: per head, rows [2, d/2] -> [d/2, 2]."""
    rows = weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
    return rows.swapaxes(1, 2).reshape(weight.shape)


def byte_tokens() -> list[str]:
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    table = bytes_to_unicode()
    return [table[b] for b in range(256)]


# Random blocks: their float16 scales, at these byte offsets of each block, are set
# small so the values stay moderate.
_RANDOM_BLOCK_SCALES = {
    "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,), "IQ4_NL": (0,), "Q5_0": (0,),
    "Q5_1": (0, 2),
}
# Types gguf-py cannot quantize: write_gguf writes random blocks for them.
_RANDOM_ONLY = ("Q4_K", "Q5_K", "Q6_K", "IQ4_NL")


def random_blocks(shape: tuple[int, ...], kind: str, seed: int = 0) -> np.ndarray:
    """Random quantized bytes of type ``kind`` for a float tensor of ``shape``."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rows, cols = shape
    data = np.random.default_rng(seed).integers(0, 256, (rows, cols // block, size), np.uint8)
    scale = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    for offset in _RANDOM_BLOCK_SCALES[kind]:
        data[..., offset : offset + 2] = scale
    return data.reshape(rows, cols // block * size)


def write_gguf(
    path: Path,
    model: Any,
    arch: str,
    quant: dict[str, str] | None = None,
    tokenizer: bool = True,
    skip: tuple[str, ...] = (),
    extra: dict[str, np.ndarray] | None = None,
    rope_freqs: np.ndarray | None = None,
    orig_ctx: int | None = None,
) -> Path:
    """Write ``model`` (an HF ``*ForCausalLM``) as a GGUF file of architecture ``arch``.

    ``quant`` maps GGUF tensor-name suffixes (e.g. ``"ffn_up.weight"``) to a type name
    (``"Q8_0"``, ``"Q4_0"``, ``"F16"``, ...); other tensors are F32. ``skip`` leaves
    GGUF tensors out; ``extra`` adds raw F32 tensors.
    """
    import gguf

    cfg = model.config
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    writer = gguf.GGUFWriter(str(path), "llama" if arch == "mixtral" else arch)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    rope = getattr(cfg, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)  # Gemma 3: one set per layer kind
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    _arch_metadata(writer, cfg, arch)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(cfg, "rope_theta", 1e4))))
    if orig_ctx is not None:
        writer.add_rope_scaling_orig_ctx_len(orig_ctx)
    writer.add_vocab_size(cfg.vocab_size)
    if tokenizer:
        tokens = byte_tokens() + [m.replace(" ", "") for m in MERGES] + SPECIAL_TOKENS
        tokens += [f"<|pad{i}|>" for i in range(cfg.vocab_size - len(tokens))]
        types = [1] * (256 + len(MERGES)) + [3] * (len(tokens) - 256 - len(MERGES))
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(MERGES)
        writer.add_bos_token_id(BOS_ID)
        writer.add_eos_token_id(EOS_ID)
        writer.add_add_bos_token(False)
        writer.add_chat_template(CHAT_TEMPLATE)
    quant = quant or {}
    state = _llama_cpp_tensors(
        {k: v.detach().float().numpy() for k, v in model.state_dict().items()}, arch
    )
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for hf_name, value in state.items():
        name = gguf_name(hf_name, arch)
        if name in skip:
            continue
        if arch in ("llama", "mixtral") and (".attn_q." in name or ".attn_k." in name):
            value = llama_cpp_permute(value, heads if ".attn_q." in name else kv_heads)
        kind = next((q for suffix, q in quant.items() if name.endswith(suffix)), "F32")
        qtype = gguf.GGMLQuantizationType[kind]
        if kind == "F32":
            writer.add_tensor(name, value.astype(np.float32))
        elif kind == "F16":
            writer.add_tensor(name, value.astype(np.float16))
        elif kind in _RANDOM_ONLY:
            writer.add_tensor(name, random_blocks(value.shape, kind), raw_dtype=qtype)
        else:
            writer.add_tensor(name, gguf.quants.quantize(value, qtype), raw_dtype=qtype)
    if rope_freqs is not None:
        writer.add_tensor("rope_freqs.weight", rope_freqs.astype(np.float32))
    for name, value in (extra or {}).items():
        writer.add_tensor(name, value.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
