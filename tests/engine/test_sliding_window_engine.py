"""A model whose every layer slides, through the whole engine: the Rust scheduler drops
the blocks that leave the window (their table entries point at the scratch block), the
kernels never read them, and greedy decoding far past the window still equals
transformers'. Blocks in use stay bounded by the window while the sequence grows."""

from __future__ import annotations

from pathlib import Path

import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
from kvpage import LLM, SamplingParams
from model_fixtures import build_hf_model, hf_greedy, save_hf_model

WINDOW, BLOCK = 8, 4


def test_all_sliding_model_frees_blocks_and_matches_transformers(tmp_path: Path) -> None:
    model = build_hf_model("mistral", seed=8, sliding_window=WINDOW)
    directory = save_hf_model(model, tmp_path)
    llm = LLM(str(directory), block_size=BLOCK, max_model_len=128, max_num_seqs=2,
              num_gpu_blocks=64, enable_prefix_caching=True)
    engine = llm.engine
    assert engine.scheduler.sliding_window == WINDOW
    prompts = [[7, 7, 7, 11, 13, 200, 17, 19, 23, 29, 31, 37, 41], [1, 5, 9, 200, 3]]
    new_tokens = 40
    most = 0

    def watch() -> None:
        nonlocal most
        most = max(most, engine.scheduler.stats()["num_referenced_blocks"])

    params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), {"prompt_token_ids": prompt}, params)
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = out.outputs[0].token_ids
        watch()
    for i, prompt in enumerate(prompts):
        assert list(outputs[str(i)]) == hf_greedy(model, prompt, new_tokens), f"prompt {i}"
    # Two sequences of up to 53 tokens would hold 14 blocks each without the window; with
    # it each keeps ceil((W - 1) / B) + 1 = 3 (+ the next step's block).
    assert most <= 2 * (-(-(WINDOW - 1) // BLOCK) + 2)
    assert engine.scheduler.stats()["num_referenced_blocks"] == 0


def test_prefix_reuse_across_the_window_boundary_matches_transformers(tmp_path: Path) -> None:
    """Requests sharing prompts shorter and longer than the window, one after another
    with prefix caching on: whatever the cache offers back must hold the window's KV."""
    model = build_hf_model("mistral", seed=9, sliding_window=WINDOW)
    directory = save_hf_model(model, tmp_path)
    llm = LLM(str(directory), block_size=BLOCK, max_model_len=128, max_num_seqs=2,
              num_gpu_blocks=64, enable_prefix_caching=True)
    shared = [9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11, 12, 13, 14]
    prompts = [shared[:6], shared[:6] + [40, 41], shared, shared + [50, 51, 52], shared]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for prompt in prompts:  # one at a time: each may reuse what the previous cached
        out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
        assert list(out[0].outputs[0].token_ids) == hf_greedy(model, prompt, 12), prompt
    assert llm.engine.scheduler.stats()["num_referenced_blocks"] == 0
