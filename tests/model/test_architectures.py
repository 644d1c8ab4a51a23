"""Every registered architecture against transformers: tiny random checkpoints built by
transformers' own config classes, loaded from the HF directory, float32 on CPU.

Prefill logits of one prompt straight through the decoder, then greedy tokens and every
generated token's logprob of two prompts batched in shared steps through the model
runner (layer groups, buckets, sampler), each against HF generating it alone (max |Δ
logprob| <= 1e-4). Sliding-window models also run past their window."""

from __future__ import annotations

from pathlib import Path

import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import numpy as np
import pytest
from kvpage.model import ModelConfig, load_model
from kvpage.model.architectures import SUPPORTED_ARCHITECTURES
from kvpage.model.config_types import SLIDING_ATTENTION
from model_fixtures import (
    build_hf_model,
    check_engine_matches_hf,
    hf_logits,
    prefill_logits,
    save_hf_model,
)

PROMPT = [7, 7, 7, 11, 13, 200, 17, 19, 23, 29, 31, 37, 41]
SHORT = [1, 5, 9, 200, 3]

# fixture name -> what the loaded config must show (the feature under test is on).
ARCHITECTURES = {
    "qwen3_moe": lambda c: c.moe.num_experts == 8 and not c.is_moe_layer(1),
    "qwen2_moe": lambda c: c.moe.shared_expert_intermediate_size == 48,
    "mixtral": lambda c: c.moe.top_k == 2 and c.moe.norm_topk_prob,
    "olmoe": lambda c: c.qk_norm_over == "projection",
    "gemma2": lambda c: c.attn_logit_softcap == 50.0 and c.final_logit_softcap == 30.0,
    "gemma3": lambda c: c.rope_local is not None and c.rope_local.theta == 500.0,
    "phi3": lambda c: c.rotary_dim == 8,
}


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_architecture_matches_transformers(arch: str, tmp_path: Path) -> None:
    model = build_hf_model(arch, seed=3)
    directory = save_hf_model(model, tmp_path)
    config, params = load_model(directory)
    assert ARCHITECTURES[arch](config)
    np.testing.assert_allclose(prefill_logits(config, params, PROMPT), hf_logits(model, PROMPT),
                               atol=1e-4, rtol=0)
    check_engine_matches_hf(model, directory, [PROMPT, SHORT], 10)


@pytest.mark.parametrize("arch", ["gemma2", "mistral"])
def test_sliding_window_past_the_window_matches_transformers(arch: str, tmp_path: Path
                                                             ) -> None:
    """A window of 6 positions, prompts of 13 and 5 tokens and 10 new ones: every sliding
    layer's queries past position 6 see only the window (transformers masks the same)."""
    layer_types = ["sliding_attention", "full_attention"] if arch == "gemma2" else None
    model = build_hf_model(arch, seed=4, sliding_window=6, **(
        {"layer_types": layer_types} if layer_types else {}
    ))
    directory = save_hf_model(model, tmp_path)
    config, params = load_model(directory)
    assert config.sliding_window == 6 and config.layer_type(0) == SLIDING_ATTENTION
    np.testing.assert_allclose(prefill_logits(config, params, PROMPT), hf_logits(model, PROMPT),
                               atol=1e-4, rtol=0)
    check_engine_matches_hf(model, directory, [PROMPT, SHORT], 10)


def test_every_registered_architecture_is_tested() -> None:
    tested = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
              "Qwen3ForCausalLM"}  # tests/model/test_model_parity.py
    for arch in ARCHITECTURES:
        cfg = build_hf_model.__globals__["hf_config"](arch)
        tested.add(ModelConfig.from_hf_dict({**cfg.to_dict(),
                                             "architectures": cfg.architectures}).architecture)
    assert tested == set(SUPPORTED_ARCHITECTURES)


def test_unknown_architecture_names_it_and_the_supported_ones() -> None:
    with pytest.raises(ValueError, match=r"'DeepseekV3ForCausalLM'.*Gemma2ForCausalLM"):
        ModelConfig.from_hf_dict({"architectures": ["DeepseekV3ForCausalLM"]})
