"""Parity of kvpage's decoder with HF transformers on tiny random models (float32, CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import numpy as np
import pytest
from kvpage.model import load_model
from model_fixtures import (
    DeviceSamplingParams,
    ModelRunner,
    PlainPlanner,
    build_hf_model,
    generate,
    hf_greedy,
    hf_logits,
    prefill_logits,
    save_hf_model,
)

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "mistral": ("mistral", {}),  # stock sliding_window 4096 > max_model_len: accepted
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 32}),  # head_dim != hidden / heads
    "llama-llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
}

PROMPTS = [
    [1, 5, 9, 200, 3],
    [7, 7, 7, 11, 13, 200, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73, 79, 83],
    [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13],
    [250],
]
NEW_TOKENS = 32


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    arch, overrides = VARIANTS[request.param]
    model = build_hf_model(arch, seed=len(request.param), **overrides)
    directory = save_hf_model(model, Path(tmp_path_factory.mktemp(request.param)))
    config, params = load_model(directory)
    runner = ModelRunner(
        config,
        params,
        num_blocks=96,
        block_size=4,
        max_model_len=64,
        max_num_seqs=8,
        token_buckets=(32,),
        seq_buckets=(4,),
        max_logprobs=4,
    )
    expected = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    return request.param, model, config, params, runner, expected


def test_config_matches_variant(variant: Any) -> None:
    name, model, config, _, _, _ = variant
    assert config.tie_word_embeddings == model.config.tie_word_embeddings
    assert config.qkv_bias == (name == "qwen2")
    assert config.qk_norm == (name == "qwen3")
    assert config.rope.rope_type == ("llama3" if "llama3" in name else "default")


def test_prompt_logits_match_hf(variant: Any) -> None:
    _, model, config, params, _, _ = variant
    prompt = PROMPTS[1]
    expected = hf_logits(model, prompt)
    got = prefill_logits(config, params, prompt)
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def test_greedy_generation_alone_matches_hf(variant: Any) -> None:
    _, _, _, _, runner, expected = variant
    for prompt, want in zip(PROMPTS[:3], expected, strict=False):
        assert generate(runner, [prompt], NEW_TOKENS, token_budget=32)[0] == want


def test_greedy_batched_chunked_prefill_matches_hf(variant: Any) -> None:
    _, _, _, _, runner, expected = variant
    # A 12-token budget and 5-token chunks split the long prompts over several steps,
    # each mixed with decodes of the sequences that already finished their prefill.
    got = generate(runner, PROMPTS, NEW_TOKENS, token_budget=12, chunk_size=5)
    assert got == expected


def test_first_token_logprobs_match_hf(variant: Any) -> None:
    _, model, _, _, runner, _ = variant

    prompt = PROMPTS[2]
    planner = PlainPlanner(runner.num_blocks, runner.block_size, token_budget=32)
    runner.set_request(0, DeviceSamplingParams(temperature=0.0, logprobs=4), prompt)
    planner.add(0, prompt, 1)
    out = runner.execute(planner.next_plan())
    logits = hf_logits(model, prompt)[-1].astype(np.float64)
    log_probs = logits - np.log(np.exp(logits - logits.max()).sum()) - logits.max()
    token = int(out.sampled_token_ids[0])
    assert token == int(np.argmax(logits))
    np.testing.assert_allclose(out.logprobs[0], log_probs[token], atol=1e-4)
    assert out.ranks[0] == 1
    assert out.top_token_ids is not None and out.top_logprobs is not None
    np.testing.assert_array_equal(out.top_token_ids[0], np.argsort(-log_probs)[:4])
    np.testing.assert_allclose(out.top_logprobs[0], np.sort(log_probs)[::-1][:4], atol=1e-4)
