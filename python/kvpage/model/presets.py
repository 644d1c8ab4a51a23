"""Well-known model shapes for random-weight benchmarking (no download needed).

This file owns :data:`PRESETS` and :func:`preset`. The numbers are the public
hyper-parameters of each model family; pair a preset with
:func:`kvpage.model.loader.random_params` to benchmark at real shapes.
"""

from __future__ import annotations

from kvpage.model.config import ModelConfig, RopeConfig

_LLAMA3_ROPE = RopeConfig(theta=500000.0)


def _llama31_rope(factor: float) -> RopeConfig:
    return RopeConfig(
        theta=500000.0,
        rope_type="llama3",
        factor=factor,
        low_freq_factor=1.0,
        high_freq_factor=4.0,
        original_max_position_embeddings=8192,
    )


PRESETS: dict[str, ModelConfig] = {
    "tiny-llama": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=512, hidden_size=64,
        intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
        rms_norm_eps=1e-5, max_position_embeddings=2048, dtype="float32",
    ),
    "llama-3-8b": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope=_LLAMA3_ROPE, max_position_embeddings=8192,
        eos_token_ids=(128001, 128009),
    ),
    "llama-3.1-8b": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope=_llama31_rope(8.0), max_position_embeddings=131072,
        eos_token_ids=(128001, 128008, 128009),
    ),
    "llama-3.2-1b": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=2048,
        intermediate_size=8192, num_layers=16, num_heads=32, num_kv_heads=8, head_dim=64,
        rms_norm_eps=1e-5, rope=_llama31_rope(32.0), max_position_embeddings=131072,
        tie_word_embeddings=True, eos_token_ids=(128001, 128008, 128009),
    ),
    "mistral-7b": ModelConfig(
        architecture="MistralForCausalLM", vocab_size=32768, hidden_size=4096,
        intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        rms_norm_eps=1e-5, rope=RopeConfig(theta=1000000.0), max_position_embeddings=32768,
        eos_token_ids=(2,),
    ),
    "qwen2.5-0.5b": ModelConfig(
        architecture="Qwen2ForCausalLM", vocab_size=151936, hidden_size=896,
        intermediate_size=4864, num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64,
        rope=RopeConfig(theta=1000000.0), max_position_embeddings=32768,
        tie_word_embeddings=True, qkv_bias=True, eos_token_ids=(151643,),
    ),
    "qwen2.5-7b": ModelConfig(
        architecture="Qwen2ForCausalLM", vocab_size=152064, hidden_size=3584,
        intermediate_size=18944, num_layers=28, num_heads=28, num_kv_heads=4, head_dim=128,
        rope=RopeConfig(theta=1000000.0), max_position_embeddings=32768,
        qkv_bias=True, eos_token_ids=(151643,),
    ),
    "qwen3-0.6b": ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=1024,
        intermediate_size=3072, num_layers=28, num_heads=16, num_kv_heads=8, head_dim=128,
        rope=RopeConfig(theta=1000000.0), max_position_embeddings=40960,
        tie_word_embeddings=True, qk_norm=True, eos_token_ids=(151645,),
    ),
    "qwen3-8b": ModelConfig(
        architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=4096,
        intermediate_size=12288, num_layers=36, num_heads=32, num_kv_heads=8, head_dim=128,
        rope=RopeConfig(theta=1000000.0), max_position_embeddings=40960,
        qk_norm=True, eos_token_ids=(151645,),
    ),
}


def preset(name: str) -> ModelConfig:
    """The preset called ``name``; ValueError listing the known names otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown preset {name!r}; known presets: {', '.join(PRESETS)}") from None
