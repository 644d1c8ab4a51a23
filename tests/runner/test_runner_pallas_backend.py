"""The runner on the Pallas kernels (interpreted on CPU) agrees with HF greedy decoding."""

from __future__ import annotations

from pathlib import Path

import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import pytest
from kvpage.kernels import dispatch
from kvpage.model import get_attention_backend, load_model
from kvpage.runner import ModelRunner
from model_fixtures import build_hf_model, generate, hf_greedy, save_hf_model


def test_backend_resolution(monkeypatch: pytest.MonkeyPatch) -> None:
    # The default follows the platform: the Pallas kernels (with their decode kernel) on
    # GPU, never the slow interpreted Pallas kernels elsewhere.
    monkeypatch.setattr(dispatch, "on_gpu", lambda: True)
    on_gpu = get_attention_backend(None)
    assert (on_gpu.name, on_gpu.decode_specialized) == ("pallas", True)
    monkeypatch.setattr(dispatch, "on_gpu", lambda: False)
    off_gpu = get_attention_backend(None)
    assert off_gpu.name != "pallas" and not off_gpu.decode_specialized
    # Explicit names are honoured on any platform.
    reference = get_attention_backend("reference")
    assert (reference.name, reference.decode_specialized) == ("reference", False)
    pallas = get_attention_backend("pallas")
    assert (pallas.name, pallas.decode_specialized) == ("pallas", True)
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
    assert runner.executables.warmup_buckets() == [(8, 2, False), (8, 2, True)]
    prompts = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [40, 41, 42]]
    got = generate(runner, prompts, 5, token_budget=8, chunk_size=5)
    assert got == [hf_greedy(model, p, 5) for p in prompts]
    # Both the mixed and the pure-decode kernels ran.
    assert runner.executables.compiled_buckets == [(8, 2, False), (8, 2, True)]
