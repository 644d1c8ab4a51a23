"""Long-context RoPE types (yarn, longrope, dynamic) against transformers: inverse
frequencies, attention scaling and cos/sin tables, config / GGUF parsing, and greedy +
logprob parity of tiny random models (float32, CPU)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import gguf_bytes
import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import numpy as np
import pytest
from kvpage.model import CheckpointError, ModelConfig, RopeConfig, load_model
from kvpage.model.gguf_loader import read_gguf_config
from kvpage.model.rope import (
    attention_scaling,
    config_rope_cos_sin,
    inverse_frequencies,
    long_inverse_frequencies,
)
from model_fixtures import (
    build_hf_model,
    check_engine_matches_hf,
    hf_greedy_logits,
    hf_logits,
    log_softmax,
    paged_greedy,
    prefill_logits,
    save_hf_model,
)

HEAD_DIM = 16
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 128}
# Phi-3-style: per-frequency divisors, the long ones above 16 tokens; factor 64 / 16 = 4.
LONGROPE = {
    "rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 16,
    "short_factor": [1.0, 1.02, 1.05, 1.1, 1.2, 1.4, 1.7, 2.0],
    "long_factor": [1.0, 1.3, 1.9, 2.8, 4.0, 6.5, 9.0, 12.0],
}
DYNAMIC = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}


def hf_llama_config(rope: dict[str, Any], head_dim: int = 128, max_pos: int = 131072,
                    **extra: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(hidden_size=256, num_attention_heads=2, head_dim=head_dim,
                       rope_parameters=dict(rope), max_position_embeddings=max_pos, **extra)


def kvpage_config(hf: Any) -> ModelConfig:
    return ModelConfig.from_hf_dict({**hf.to_dict(), "architectures": ["LlamaForCausalLM"]})


def hf_cos_sin(hf: Any, positions: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """A fresh transformers rotary module's cos/sin for one sequence's positions."""
    import torch
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    module = LlamaRotaryEmbedding(hf)
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = module(x, torch.tensor([positions]))
    return cos[0].numpy(), sin[0].numpy()


# --------------------------------------------------------------------------- yarn
YARN_CASES = {
    "qwen3": {**YARN, "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 32768},
    "gpt-oss": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0,
                "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096},
    "deepseek-mscale": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                        "mscale": 0.707, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1,
                        "original_max_position_embeddings": 4096},
    "attention-factor": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 8.0,
                         "attention_factor": 1.3, "original_max_position_embeddings": 8192},
    "factor-from-context": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": None,
                            "original_max_position_embeddings": 32768},
}


@pytest.mark.parametrize("name", list(YARN_CASES))
def test_yarn_frequencies_scaling_and_tables_match_transformers(name: str) -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = hf_llama_config(YARN_CASES[name])
    expected, factor = ROPE_INIT_FUNCTIONS["yarn"](hf, None)
    config = kvpage_config(hf)
    assert config.rope.rope_type == "yarn"
    got = inverse_frequencies(config.head_dim, config.rope, config.max_position_embeddings)
    np.testing.assert_allclose(got, expected.numpy(), rtol=1e-6)
    assert attention_scaling(config.rope, config.max_position_embeddings) == pytest.approx(
        factor, rel=1e-12)
    assert factor != 1.0
    positions = [0, 1, 2, 37, 500, 4095]
    cos, sin = config_rope_cos_sin(config, np.asarray(positions, np.int32))
    want_cos, want_sin = hf_cos_sin(hf, positions)
    # A 1-ulp difference of a float32 frequency (the float32 powers of numpy / XLA and
    # torch are not all correctly rounded) moves the angle at position p by ~p ulps.
    tolerance = 2e-6 + 2e-7 * np.asarray(positions, np.float64)[:, None]
    assert (np.abs(np.asarray(cos) - want_cos) <= tolerance).all()
    assert (np.abs(np.asarray(sin) - want_sin) <= tolerance).all()


def test_yarn_config_is_hashable_and_parses_both_dialects() -> None:
    new = kvpage_config(hf_llama_config(YARN))
    old_raw = {**hf_llama_config({}).to_dict(), "architectures": ["LlamaForCausalLM"]}
    old_raw.pop("rope_parameters")
    old_raw.update(rope_theta=10000.0, rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})
    old = ModelConfig.from_hf_dict(old_raw)
    assert old.rope == new.rope
    assert hash(new.rope) == hash(old.rope)
    assert new.rope.truncate and new.rope.beta_fast == 32.0 and new.rope.beta_slow == 1.0


# --------------------------------------------------------------------------- longrope
def test_longrope_short_and_long_frequencies_match_transformers() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = hf_llama_config(LONGROPE, head_dim=HEAD_DIM, max_pos=64)
    config = kvpage_config(hf)
    assert config.rope.short_factor == tuple(LONGROPE["short_factor"])
    assert config.rope.factor == 4.0
    short, factor = ROPE_INIT_FUNCTIONS["longrope"](hf, None)
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](hf, None, seq_len=17)
    np.testing.assert_allclose(
        inverse_frequencies(HEAD_DIM, config.rope, 64), short.numpy(), rtol=1e-6)
    np.testing.assert_allclose(
        long_inverse_frequencies(HEAD_DIM, config.rope), long.numpy(), rtol=1e-6)
    assert attention_scaling(config.rope, 64) == pytest.approx(factor, rel=1e-12)
    assert factor == pytest.approx((1 + np.log(4) / np.log(16)) ** 0.5)


@pytest.mark.parametrize(("rope", "max_pos", "threshold"),
                         [(LONGROPE, 64, 16), (DYNAMIC, 16, 16)])
def test_length_dependent_tables_pick_per_sequence(rope: dict[str, Any], max_pos: int,
                                                    threshold: int) -> None:
    """One step mixing three sequences: each row's cos/sin is what transformers computes
    for that sequence alone (its length: the KV length after the step)."""
    hf = hf_llama_config(rope, head_dim=HEAD_DIM, max_pos=max_pos)
    config = kvpage_config(hf)
    # (first position, number of tokens in this step) per sequence: a short prefill, a
    # decode just past the threshold, a prefill longer than the threshold.
    seqs = [(0, 9), (threshold, 1), (0, threshold + 7)]
    positions = np.concatenate([np.arange(s, s + n) for s, n in seqs]).astype(np.int32)
    cu = np.cumsum([0] + [n for _, n in seqs]).astype(np.int32)
    kv_lens = np.asarray([s + n for s, n in seqs], np.int32)
    # Padding: an empty row and two padding tokens.
    positions = np.concatenate([positions, [0, 0]]).astype(np.int32)
    cu = np.concatenate([cu, [cu[-1]]]).astype(np.int32)
    kv_lens = np.concatenate([kv_lens, [0]]).astype(np.int32)
    cos, sin = config_rope_cos_sin(config, positions, cu, kv_lens)
    cos, sin = np.asarray(cos), np.asarray(sin)
    for i, (start, n) in enumerate(seqs):
        # transformers' rotary module sees the whole sequence up to its last token.
        want_cos, want_sin = hf_cos_sin(hf, list(range(start + n)))
        rows = slice(cu[i], cu[i + 1])
        np.testing.assert_allclose(cos[rows], want_cos[start:], atol=2e-6)
        np.testing.assert_allclose(sin[rows], want_sin[start:], atol=2e-6)
    # Both sides of the threshold really differ.
    below, _ = hf_cos_sin(hf, list(range(threshold)))
    above, _ = hf_cos_sin(hf, list(range(threshold + 1)))
    assert np.abs(below[-1] - above[-2]).max() > 1e-3


def test_dynamic_frequencies_match_transformers_above_the_threshold() -> None:
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = hf_llama_config(DYNAMIC, head_dim=HEAD_DIM, max_pos=16)
    config = kvpage_config(hf)
    assert config.rope.factor == 2.0
    plain, scale = ROPE_INIT_FUNCTIONS["dynamic"](hf, None)
    assert scale == 1.0
    np.testing.assert_allclose(inverse_frequencies(HEAD_DIM, config.rope, 16), plain.numpy(),
                               rtol=1e-6)
    for length in (16, 17, 40):
        cos, _ = config_rope_cos_sin(config, np.arange(length, dtype=np.int32))
        np.testing.assert_allclose(np.asarray(cos), hf_cos_sin(hf, list(range(length)))[0],
                                   atol=2e-6)


# --------------------------------------------------------------------------- parsing
def test_unsupported_rope_type_names_it_and_the_supported_ones() -> None:
    raw = {**hf_llama_config({}).to_dict(), "architectures": ["LlamaForCausalLM"],
           "rope_parameters": {"rope_type": "mrope", "factor": 2.0}}
    with pytest.raises(ValueError, match="'mrope'.*yarn, longrope, dynamic"):
        ModelConfig.from_hf_dict(raw)
    with pytest.raises(ValueError, match="unsupported rope_type 'su'"):
        ModelConfig(architecture="LlamaForCausalLM", vocab_size=8, hidden_size=8,
                    intermediate_size=8, num_layers=1, num_heads=1, num_kv_heads=1,
                    head_dim=8, rope=RopeConfig(rope_type="su"))


def test_bad_longrope_and_dynamic_configs_are_errors(tmp_path: Path) -> None:
    raw = {**hf_llama_config(LONGROPE, head_dim=HEAD_DIM, max_pos=64).to_dict(),
           "architectures": ["LlamaForCausalLM"]}
    raw["rope_parameters"] = {**LONGROPE, "long_factor": [1.0] * 3}
    with pytest.raises(ValueError, match="long_factor has 3 values, expected head_dim / 2 = 8"):
        ModelConfig.from_hf_dict(raw)
    raw["rope_parameters"] = {k: v for k, v in LONGROPE.items() if k != "short_factor"}
    with pytest.raises(ValueError, match="short_factor"):
        ModelConfig.from_hf_dict(raw)
    raw["rope_parameters"] = {"rope_type": "dynamic"}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="'dynamic' needs a 'factor'"):
        ModelConfig.from_pretrained(tmp_path)


def _gguf_config(tmp_path: Path, **fields: tuple[int, Any]) -> ModelConfig:
    meta = [f for f in gguf_bytes.metadata() if f[0] not in fields]
    meta += [(k, *v) for k, v in fields.items()]
    path = tmp_path / "rope.gguf"
    path.write_bytes(gguf_bytes.join(gguf_bytes.tiny_gguf(meta)))
    return read_gguf_config(path)


def test_gguf_yarn_metadata_maps_to_the_hf_rope(tmp_path: Path) -> None:
    s, f32, u32 = gguf_bytes.STRING, gguf_bytes.F32, gguf_bytes.U32
    context = gguf_bytes.CONTEXT
    config = _gguf_config(tmp_path, **{
        "llama.rope.scaling.type": (s, "yarn"),
        "llama.rope.scaling.factor": (f32, 4.0),
        "llama.rope.scaling.original_context_length": (u32, 16),
        "llama.rope.scaling.yarn_beta_fast": (f32, 16.0),
    })
    hf = hf_llama_config({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                          "original_max_position_embeddings": 16, "beta_fast": 16.0},
                         head_dim=gguf_bytes.HEAD_DIM, max_pos=context)
    assert config.rope == kvpage_config(hf).rope
    assert config.max_position_embeddings == context
    # yarn_log_multiplier is HF's mscale_all_dim (mscale 1); yarn_attn_factor its
    # attention_factor.
    config = _gguf_config(tmp_path, **{
        "llama.rope.scaling.type": (s, "yarn"), "llama.rope.scaling.factor": (f32, 4.0),
        "llama.rope.scaling.yarn_log_multiplier": (f32, 0.5),
    })
    assert (config.rope.mscale, config.rope.mscale_all_dim) == (1.0, 0.5)
    assert config.rope.original_max_position_embeddings == context
    config = _gguf_config(tmp_path, **{
        "llama.rope.scaling.type": (s, "yarn"), "llama.rope.scaling.factor": (f32, 4.0),
        "llama.rope.scaling.yarn_attn_factor": (f32, 1.25),
    })
    assert attention_scaling(config.rope, context) == 1.25
    with pytest.raises(CheckpointError, match="yarn_ext_factor"):
        _gguf_config(tmp_path, **{"llama.rope.scaling.type": (s, "yarn"),
                                  "llama.rope.scaling.yarn_ext_factor": (f32, 0.5)})
    with pytest.raises(CheckpointError, match="rope scaling 'longrope'; supported: .*yarn"):
        _gguf_config(tmp_path, **{"llama.rope.scaling.type": (s, "longrope")})


# --------------------------------------------------------------------------- end to end
def test_qwen3_yarn_greedy_and_logprobs_match_hf(tmp_path: Path) -> None:
    model = build_hf_model("qwen3", seed=5, rope_parameters=dict(YARN))
    directory = save_hf_model(model, tmp_path)
    config, params = load_model(directory)
    assert config.rope.rope_type == "yarn"
    prompt = [7, 7, 7, 11, 13, 200, 17, 19, 23, 29, 31, 37, 41]
    np.testing.assert_allclose(prefill_logits(config, params, prompt), hf_logits(model, prompt),
                               atol=1e-4, rtol=0)
    check_engine_matches_hf(model, directory, [prompt, [1, 5, 9, 200, 3]], 12)


def test_llama_longrope_greedy_and_logprobs_match_hf_on_both_sides(tmp_path: Path) -> None:
    """Prompts that stay below the 16-token original context, start above it, and cross
    it while decoding, sharing steps: each matches HF's Llama generating it alone."""
    model = build_hf_model("llama", seed=7, max_position_embeddings=64,
                           rope_parameters=dict(LONGROPE))
    directory = save_hf_model(model, tmp_path)
    below = [1, 5, 9, 200, 3]  # 5 + 8 <= 16: short factors throughout
    above = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22]
    crossing = [250, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59]  # 12 + 8 crosses 16
    check_engine_matches_hf(model, directory, [below, above, crossing], 8)


def test_llama_dynamic_ntk_matches_hf_past_max_position_embeddings(tmp_path: Path) -> None:
    """Below max_position_embeddings dynamic NTK is plain RoPE; past it (reachable only
    through forward directly: the runner caps max_model_len at it) each step's base
    follows the sequence length, as in HF's per-forward update."""
    model = build_hf_model("llama", seed=9, max_position_embeddings=16,
                           rope_parameters=dict(DYNAMIC))
    config, params = load_model(save_hf_model(model, tmp_path))
    prompt = [7, 7, 7, 11, 13, 200, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71]
    # Prompt logits first: transformers' module remembers the longest length it saw.
    np.testing.assert_allclose(prefill_logits(config, params, prompt), hf_logits(model, prompt),
                               atol=1e-4, rtol=0)
    want_tokens, want_logits = hf_greedy_logits(model, prompt, 6)
    tokens, logits = paged_greedy(config, params, prompt, 6)
    assert tokens == want_tokens
    np.testing.assert_allclose(log_softmax(logits), log_softmax(want_logits), atol=1e-4)
