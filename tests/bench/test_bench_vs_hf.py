"""``kvpage bench vs-hf`` on the tiny model: both sides run in their own processes, the
figures are computed from the same requests, and greedy tokens agree with HF."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from kvpage.bench import vs_hf
from kvpage.bench.vs_hf_sides import prompts_for_pass


def test_scenarios_are_seeded_and_named() -> None:
    mix = vs_hf.scenario("mix", seed=3)
    assert mix == vs_hf.scenario("mix", seed=3)
    assert mix["prompt_lens"] != vs_hf.scenario("mix", seed=4)["prompt_lens"]
    assert len(mix["prompt_lens"]) == len(mix["output_lens"]) == 32
    assert max(mix["output_lens"]) > 2 * min(mix["output_lens"])  # a long-tailed mix
    assert vs_hf.scenario("batch1")["one_at_a_time"]
    square = vs_hf.scenario("64x64")
    assert square["prompt_lens"] == [32] * 64 and square["output_lens"] == [64] * 64
    with pytest.raises(ValueError, match="unknown scenario"):
        vs_hf.scenario("huge")


def test_passes_use_other_tokens_of_the_same_lengths() -> None:
    spec = vs_hf.scenario("mix", seed=0)
    first, second = prompts_for_pass(spec, 0), prompts_for_pass(spec, 1)
    assert [len(p) for p in first] == [len(p) for p in second] == spec["prompt_lens"]
    assert first != second  # the warm pass finds nothing in the prefix cache
    low, high = spec["token_range"]
    assert all(low <= t < high for p in first for t in p)


def test_both_sides_on_the_tiny_model(tiny_model_dir: Path) -> None:
    spec = {
        "name": "tiny",
        "seed": 0,
        "prompt_lens": [5, 9, 3],
        "output_lens": [6, 2, 4],
        "one_at_a_time": False,
        "token_range": [3, 200],
        "model": str(tiny_model_dir),
        "hf_batch_size": 2,
    }
    result = vs_hf.compare(spec, timeout_s=600)
    assert result["useful_output_tokens"] == 12
    assert result["kvpage_tok_s"] > 0 and result["hf_tok_s"] > 0
    assert result["ratio"] == pytest.approx(result["kvpage_tok_s"] / result["hf_tok_s"])
    assert result["hf"]["batch_size"] == 2
    assert result["kvpage"]["compiled_executables"] >= 1
    # Greedy parity with transformers, padded batches and all.
    assert result["greedy_identical"] == 3


def test_cli_rejects_bad_batch_size() -> None:
    args = argparse.Namespace(hf_batch_size=0)
    with pytest.raises(ValueError, match="--hf-batch-size"):
        vs_hf.main(args)
