"""The runner on the Pallas kernels (interpreted on CPU) agrees with HF greedy decoding."""

from __future__ import annotations

from pathlib import Path

import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import pytest
from kvpage.model import get_attention_backend, load_model
from kvpage.runner import ModelRunner
from model_fixtures import build_hf_model, generate, hf_greedy, save_hf_model

import pallas_kernels

pytestmark = pytest.mark.skipif(
    not hasattr(pallas_kernels, "paged_attention"), reason="pallas_kernels has no dispatcher"
)


def test_backend_resolution() -> None:
    assert get_attention_backend(None).name in ("reference", "pallas")
    assert get_attention_backend("reference").decode_specialized is False
    assert get_attention_backend("pallas").decode_specialized is True
    with pytest.raises(ValueError, match="nope"):
        get_attention_backend("nope")


def test_pallas_backend_greedy_matches_hf(tmp_path: Path) -> None:
    # One layer: the interpreted kernels are slow to compile on CPU.
    model = build_hf_model("llama", seed=21, num_hidden_layers=1)
    config, params = load_model(save_hf_model(model, tmp_path))
    runner = ModelRunner(
        config, params, num_blocks=16, block_size=8, max_model_len=32, max_num_seqs=4,
        token_buckets=(8,), seq_buckets=(2,), max_logprobs=0, attention_backend="pallas",
    )
    assert runner.warmup_buckets() == [(8, 2, False), (8, 2, True)]
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [40, 41, 42]]
    got = generate(runner, prompts, 5, token_budget=8, chunk_size=5)
    assert got == [hf_greedy(model, p, 5) for p in prompts]
    # Both the mixed and the pure-decode kernels ran.
    assert runner.compiled_buckets == [(8, 2, False), (8, 2, True)]
