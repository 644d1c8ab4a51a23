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
    "gemma": lambda c: c.norm_offset == 1.0 and not c.sandwich_norms,
    "gemma2": lambda c: c.attn_logit_softcap == 50.0 and c.final_logit_softcap == 30.0,
    "gemma3": lambda c: c.rope_local is not None and c.rope_local.theta == 500.0,
    "phi3": lambda c: c.rotary_dim == 8,
    "gpt_oss": lambda c: c.attention_sinks and c.moe.expert_bias and c.moe.router_bias,
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


@pytest.mark.parametrize("arch", ["gemma2", "mistral", "gpt_oss"])
def test_sliding_window_past_the_window_matches_transformers(arch: str, tmp_path: Path
                                                             ) -> None:
    """A window of 6 positions, prompts of 13 and 5 tokens and 10 new ones: every sliding
    layer's queries past position 6 see only the window (transformers masks the same)."""
    layer_types = ["sliding_attention", "full_attention"] if arch != "mistral" else None
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


# fixture name -> (GGUF architecture, config overrides llama.cpp can express in GGUF).
GGUF_ARCHITECTURES = {
    "qwen3_moe": ("qwen3moe", dict(mlp_only_layers=[])),
    "qwen2_moe": ("qwen2moe", {}),
    "mixtral": ("mixtral", {}),
    "olmoe": ("olmoe", {}),
    "gemma": ("gemma", {}),
    "gemma2": ("gemma2", dict(query_pre_attn_scalar=16, sliding_window=6)),
    "gemma3": ("gemma3", dict(query_pre_attn_scalar=16, sliding_window=6,
                              rope_local_base_freq=500.0,
                              layer_types=["sliding_attention"] * 5 + ["full_attention"],
                              num_hidden_layers=6)),
    "phi3": ("phi3", {}),
}


@pytest.mark.parametrize("arch", sorted(GGUF_ARCHITECTURES))
def test_architecture_from_gguf_matches_transformers(arch: str, tmp_path: Path) -> None:
    """The same tiny model written as llama.cpp's converter writes it (stacked experts,
    Gemma's +1 norms, Phi-3's fused projections, Mixtral as ``llama``), float32, against
    transformers: the config it describes and the prefill logits."""
    from gguf_fixtures import write_gguf
    from kvpage.model.gguf_loader import load_gguf

    gguf_arch, overrides = GGUF_ARCHITECTURES[arch]
    model = build_hf_model(arch, seed=5, **overrides)
    path = write_gguf(tmp_path / f"{arch}.gguf", model, gguf_arch, tokenizer=False)
    config, params, _ = load_gguf(path)
    hf_dir_config = ModelConfig.from_hf_dict(
        {**model.config.to_dict(), "architectures": [type(model).__name__]}
    )
    assert config.architecture == hf_dir_config.architecture
    assert config.moe == hf_dir_config.moe
    assert config.layer_types == hf_dir_config.layer_types
    assert config.rope_local == hf_dir_config.rope_local
    np.testing.assert_allclose(prefill_logits(config, params, PROMPT), hf_logits(model, PROMPT),
                               atol=1e-4, rtol=0)


def test_quantized_experts_stay_in_blocks_and_match_their_dequantized_values(
        tmp_path: Path) -> None:
    """Q8_0 expert weights kept as 3-D blocks (experts gathered or grouped straight from
    their blocks, and through the runner's steps) give the logits of the same file
    dequantized at load."""
    from gguf_fixtures import write_gguf
    from kvpage.model.gguf_loader import load_gguf
    from kvpage.quant.weights import QuantizedWeight
    from model_fixtures import DeviceSamplingParams, generate, paged_greedy, tiny_runner

    model = build_hf_model("qwen3_moe", seed=6, mlp_only_layers=[])
    path = write_gguf(tmp_path / "q8.gguf", model, "qwen3moe", tokenizer=False,
                      quant={"_exps.weight": "Q8_0"})
    config, kept, _ = load_gguf(path)
    _, dense, _ = load_gguf(path, quantization="none")
    experts = kept["layers"][0]["mlp"]["experts"]["gate_proj"]["weight"]
    assert isinstance(experts, QuantizedWeight) and experts.shape == (8, 32, 64)
    want_tokens, want = paged_greedy(config, dense, PROMPT, 6)
    got_tokens, got = paged_greedy(config, kept, PROMPT, 6)
    assert got_tokens == want_tokens
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    # Through the runner's steps: the Rust expert kernel reads the blocks (a row alone on
    # its expert takes the kernel's 16-bit one-row path, hence the looser tolerance).
    runs = [generate(tiny_runner(config, p), [PROMPT, SHORT], 8,
                     DeviceSamplingParams(temperature=0.0, logprobs=1), outputs=(out := []),
                     token_budget=32) + [out] for p in (dense, kept)]
    assert runs[0][:2] == runs[1][:2]
    logprobs = [[float(o.logprobs[r]) for plan, o in run[2]
                 for r in range(len(plan.sample_rows))] for run in runs]
    np.testing.assert_allclose(logprobs[1], logprobs[0], atol=2e-3)


def test_gpt_oss_mxfp4_experts_are_dequantized_at_load(tmp_path: Path) -> None:
    """A gpt-oss checkpoint whose experts are MXFP4 blocks and scales (as released):
    kvpage dequantizes them at load and matches transformers running the same values
    (dequantized by transformers' own MXFP4 conversion)."""
    import torch
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model = build_hf_model("gpt_oss", seed=6)
    cfg = model.config
    experts, hidden, inter = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    rng = np.random.default_rng(0)
    packed: dict[str, np.ndarray] = {}
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            for name, (out, inp) in {"gate_up_proj": (2 * inter, hidden),
                                     "down_proj": (hidden, inter)}.items():
                blocks = rng.integers(0, 256, (experts, out, inp // 32, 16), dtype=np.uint8)
                scales = rng.integers(122, 126, (experts, out, inp // 32), dtype=np.uint8)
                prefix = f"model.layers.{i}.mlp.experts.{name}"
                packed[f"{prefix}_blocks"], packed[f"{prefix}_scales"] = blocks, scales
                values = convert_moe_packed_tensors(torch.from_numpy(blocks),
                                                    torch.from_numpy(scales),
                                                    dtype=torch.float32)
                getattr(layer.mlp.experts, name).copy_(values)
    directory = save_hf_model(model, tmp_path)
    (weights,) = directory.glob("*.safetensors")
    tensors = {k: v for k, v in load_file(weights).items()
               if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    save_file({**tensors, **packed}, weights, metadata={"format": "pt"})
    config, params = load_model(directory)
    np.testing.assert_allclose(prefill_logits(config, params, PROMPT), hf_logits(model, PROMPT),
                               atol=1e-4, rtol=0)
