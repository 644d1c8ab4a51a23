"""Copies of one prompt sent together prefill it once (``group_shared_prefills``): the
first copy computes it, the others wait a step and take its blocks from the prefix
cache, with the same outputs as computing it themselves."""

from __future__ import annotations

from pathlib import Path

from kvpage import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
PROMPT = {"prompt_token_ids": list(range(400, 420))}  # 2 whole blocks of 8, plus 4


def make_llm(model: Path, **overrides: object) -> LLM:
    args: dict = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128, block_size=8)
    args.update(overrides)
    return LLM(str(model), **args)


def test_copies_sent_together_prefill_once_with_the_same_outputs(tiny_model_dir: Path) -> None:
    grouped_llm = make_llm(tiny_model_dir)
    grouped = grouped_llm.generate([PROMPT] * 4, GREEDY, use_tqdm=False)
    stats = grouped_llm.engine.get_stats()
    assert [o.num_cached_tokens for o in grouped] == [0, 16, 16, 16]
    assert stats["prefill_waits"] >= 3

    alone_llm = make_llm(tiny_model_dir, group_shared_prefills=False)
    alone = alone_llm.generate([PROMPT] * 4, GREEDY, use_tqdm=False)
    # The budget (32 tokens) admits the second copy beside the first, uncached.
    assert alone[1].num_cached_tokens == 0
    assert alone_llm.engine.get_stats()["prefill_waits"] == 0
    assert [o.outputs[0].token_ids for o in grouped] == [o.outputs[0].token_ids for o in alone]
    for llm in (grouped_llm, alone_llm):
        llm.engine.check_invariants()
        assert llm.engine.get_stats()["kv_cache_usage_perc"] == 0.0
