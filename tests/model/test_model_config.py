"""ModelConfig parsing from HF config.json dialects, RoPE frequencies, presets."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import numpy as np
import pytest
from kvpage.model import PRESETS, SUPPORTED_ARCHITECTURES, CheckpointError, ModelConfig, preset
from kvpage.model.params import param_spec
from kvpage.model.rope import inverse_frequencies
from model_fixtures import hf_config

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def hf_dict(arch: str, **overrides: Any) -> dict[str, Any]:
    raw = hf_config(arch, **overrides).to_dict()
    raw["architectures"] = [
        {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
         "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[arch]
    ]
    return raw


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
def test_parse_transformers_configs(arch: str) -> None:
    config = ModelConfig.from_hf_dict(hf_dict(arch))
    assert config.model_type == arch
    assert (config.hidden_size, config.num_layers) == (64, 2)
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 2, 16)
    assert config.qkv_bias == (arch == "qwen2")
    assert not config.o_proj_bias
    assert config.qk_norm == (arch == "qwen3")
    assert config.rope.theta == 10000.0 and config.rope.rope_type == "default"
    assert config.dtype == "float32"


def test_old_and_new_rope_formats_agree() -> None:
    base = hf_dict("llama")
    base.pop("rope_parameters", None)
    old = {**base, "rope_theta": 500000.0, "rope_scaling": {**LLAMA3}, "torch_dtype": "bfloat16"}
    older = {**old, "rope_scaling": {**{k: v for k, v in LLAMA3.items() if k != "rope_type"},
                                     "type": "llama3"}}
    new = {**base, "rope_parameters": {**LLAMA3, "rope_theta": 500000.0}, "dtype": "bfloat16"}
    configs = [ModelConfig.from_hf_dict(raw) for raw in (old, older, new)]
    assert configs[0] == configs[1] == configs[2]
    assert configs[0].rope.rope_type == "llama3"
    assert configs[0].rope.theta == 500000.0
    assert configs[0].dtype == "bfloat16"
    plain = ModelConfig.from_hf_dict({**base, "rope_theta": 1234.0})
    assert plain.rope.theta == 1234.0 and plain.rope.rope_type == "default"


def test_head_dim_fallback_bias_and_tie() -> None:
    raw = hf_dict("llama", attention_bias=True, mlp_bias=True, tie_word_embeddings=True)
    raw["head_dim"] = None
    config = ModelConfig.from_hf_dict(raw)
    assert config.head_dim == 64 // 4
    assert config.qkv_bias and config.o_proj_bias and config.mlp_bias
    assert config.tie_word_embeddings
    assert "lm_head.weight" not in param_spec(config)
    assert param_spec(config)["model.layers.1.self_attn.o_proj.bias"] == (64,)


def test_qwen3_explicit_head_dim() -> None:
    config = ModelConfig.from_hf_dict(hf_dict("qwen3", head_dim=32))
    assert config.head_dim == 32 and config.q_size == 128
    spec = param_spec(config)
    assert spec["model.layers.0.self_attn.q_proj.weight"] == (128, 64)
    assert spec["model.layers.0.self_attn.k_norm.weight"] == (32,)


def test_unknown_architecture_names_it_and_the_supported_ones() -> None:
    raw = {**hf_dict("llama"), "architectures": ["GPT2LMHeadModel"]}
    with pytest.raises(ValueError) as info:
        ModelConfig.from_hf_dict(raw)
    message = str(info.value)
    assert "GPT2LMHeadModel" in message
    assert all(arch in message for arch in SUPPORTED_ARCHITECTURES)


def test_model_type_used_when_architectures_missing() -> None:
    raw = hf_dict("qwen2")
    del raw["architectures"]
    assert ModelConfig.from_hf_dict(raw).architecture == "Qwen2ForCausalLM"


def test_unsupported_rope_type_rejected() -> None:
    raw = {**hf_dict("llama"), "rope_parameters": {"rope_type": "mrope", "factor": 4.0}}
    with pytest.raises(ValueError, match="mrope"):
        ModelConfig.from_hf_dict(raw)


def test_config_file_errors(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not found"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="malformed"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="malformed"):
        ModelConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(CheckpointError, match="hidden_size"):
        ModelConfig.from_pretrained(tmp_path)


@pytest.mark.parametrize("rope", [LLAMA3, {"rope_type": "linear", "factor": 2.0}, {}])
def test_inverse_frequencies_match_transformers(rope: dict[str, Any]) -> None:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "default", **rope, "rope_theta": 500000.0}
    hf = LlamaConfig(
        hidden_size=256, num_attention_heads=2, head_dim=128, rope_parameters=params,
        max_position_embeddings=131072,
    )
    rope_type = params["rope_type"]
    if rope_type == "default":
        expected = 1.0 / (500000.0 ** (np.arange(0, 128, 2) / 128))
    else:
        expected = ROPE_INIT_FUNCTIONS[rope_type](hf, None)[0].numpy()
    config = ModelConfig.from_hf_dict({**hf.to_dict(), "architectures": ["LlamaForCausalLM"]})
    got = inverse_frequencies(config.head_dim, config.rope, config.max_position_embeddings)
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_presets_have_real_sizes() -> None:
    for name, config in PRESETS.items():
        assert preset(name) is config
    total = sum(math.prod(shape) for shape in param_spec(preset("llama-3-8b")).values())
    assert 8.0e9 < total < 8.1e9
    total = sum(math.prod(shape) for shape in param_spec(preset("qwen3-0.6b")).values())
    assert 0.59e9 < total < 0.61e9
    with pytest.raises(ValueError, match="llama-3-8b"):
        preset("nope")
