"""Speculative decoding (``speculative_config``: n-gram, suffix and draft-model drafts):
verification keeps only what the model would have produced, so every output -- greedy,
seeded sampling with logprobs, stop strings and ids, parallel samples, lengths ending
among the drafts -- is token for token the engine's without speculation, and every KV
block returns, the draft model's included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import numpy as np
import pytest
from kvpage import LLM, SamplingParams
from kvpage.engine.speculative_config import SpeculativeConfig, parse_speculative_config
from kvpage.sampling.verification import draft_rows, kept_rows

# Repetitive prompts, so the drafter finds matches in the prompt and in the output.
LOOP = [5, 17, 99, 3, 42, 7] * 4
PROMPTS: list[Any] = [
    {"prompt_token_ids": LOOP},
    {"prompt_token_ids": [8, 9, 8, 9, 8, 9, 8]},
    {"prompt_token_ids": list(range(20, 41)) * 2},
]
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}


def make_llm(model: Path, spec: dict[str, Any] | None, steps: int = 1) -> LLM:
    # The settings of test_multi_step.py: its compiled buckets are reused.
    return LLM(
        str(model), max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
        block_size=8, num_scheduler_steps=steps, warmup="full" if steps > 1 else "none",
        speculative_config=spec,
    )


@pytest.fixture(scope="module")
def other_tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another tiny model of the same shapes and tokenizer: a draft model that is often
    wrong."""
    from kvpage.model.tiny_model import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny-draft"), seed=7)


def draft_model_spec(model: Path) -> dict[str, Any]:
    # max_running = the target's max_num_seqs: the draft engine compiles the same buckets.
    return {"method": "draft_model", "model": str(model), "num_speculative_tokens": 4,
            "max_running": 4}


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path, other_tiny_model: Path) -> tuple[LLM, ...]:
    """Without speculation; with n-gram drafts; with them and multi-step decode (the two
    take turns: a step with drafts runs alone, one without may run several steps); with
    suffix drafts (across requests); drafted by the target's own weights (every greedy
    draft right) and by another model's."""
    return (make_llm(tiny_model_dir, None), make_llm(tiny_model_dir, SPEC),
            make_llm(tiny_model_dir, SPEC, steps=4),
            make_llm(tiny_model_dir, {**SPEC, "method": "suffix"}),
            make_llm(tiny_model_dir, draft_model_spec(tiny_model_dir)),
            make_llm(tiny_model_dir, draft_model_spec(other_tiny_model)))


def run_all(llm: LLM) -> list[Any]:
    free = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=30),
                        use_tqdm=False)[0].outputs[0]
    cases: list[tuple[list[Any], Any]] = [
        (PROMPTS, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)),
        # Lengths that end inside a step's drafts.
        (PROMPTS, [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                   for m in (3, 11, 26)]),
        ([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=30, stop=[free.text[6:9]])),
        ([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=30,
                                      stop_token_ids=[free.token_ids[9]])),
        # Seeded sampling draws the same keys per generated index, drafts or not.
        (PROMPTS[:2], SamplingParams(temperature=0.9, seed=3, max_tokens=25, logprobs=2,
                                     top_p=0.9, ignore_eos=True)),
        ([PROMPTS[2]], SamplingParams(temperature=0.8, seed=11, n=2, max_tokens=20,
                                      ignore_eos=True)),
        # Penalties never draft (their counts would miss the drafts).
        ([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                      repetition_penalty=1.3)),
    ]
    results = []
    for prompts, params in cases:
        for out in llm.generate(prompts, params, use_tqdm=False):
            for c in out.outputs:
                top = None
                if c.logprobs is not None:
                    top = [sorted(step.items()) for step in c.logprobs]
                results.append((list(c.token_ids), c.text, c.finish_reason, top))
    return results


def test_outputs_equal_the_engine_without_speculation(engines: tuple[LLM, ...]) -> None:
    plain, *speculating = engines
    want = run_all(plain)
    for spec in speculating:
        often_wrong = spec is engines[-1]  # another model's drafts: kept or not
        got = run_all(spec)
        assert len(want) == len(got)
        for w, g in zip(want, got, strict=True):
            assert g[:3] == w[:3]
            if w[3] is not None:  # logprobs: the target model's, at the same positions
                for ws, gs in zip(w[3], g[3], strict=True):
                    assert [t for t, _ in ws] == [t for t, _ in gs]
                    for (_, a), (_, b) in zip(ws, gs, strict=True):
                        assert a.logprob == b.logprob  # bit for bit (row-count invariant)
        stats = spec.engine._ctx.scheduler.stats()
        # A drafter that keeps missing backs off (its drafts still came and were judged).
        assert stats["spec_decode_num_draft_tokens"] > (4 if often_wrong else 20)
        assert often_wrong or stats["spec_decode_num_accepted_tokens"] > 5
    for llm in engines:
        s = llm.engine._ctx.scheduler.stats()
        assert s["num_referenced_blocks"] == 0  # every block came back
        if (draft := llm.engine.draft_model) is not None:
            assert draft.engine.scheduler.stats()["num_referenced_blocks"] == 0


def test_a_draft_model_drafts_what_it_would_generate(engines: tuple[LLM, ...]) -> None:
    # Greedy, the target drafting for itself: each draft is what the target then picks,
    # so nearly all are kept, and it keeps drafting. Another model's drafts are kept far
    # less often, so it backs off and drafts far fewer tokens for the same requests.
    drafted, kept = [], []
    for llm in engines[-2:]:
        stats = llm.engine._ctx.scheduler.stats
        before = stats()
        llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
                     use_tqdm=False)
        after = stats()
        drafted.append(after["spec_decode_num_draft_tokens"]
                       - before["spec_decode_num_draft_tokens"])
        kept.append(after["spec_decode_num_accepted_tokens"]
                    - before["spec_decode_num_accepted_tokens"])
    assert drafted[0] > 10 and kept[0] > 0.9 * drafted[0], (drafted, kept)
    assert drafted[1] < drafted[0] / 2, (drafted, kept)
    whole = engines[-1].engine._ctx.scheduler.stats()
    assert (whole["spec_decode_num_accepted_tokens"]
            < 0.5 * whole["spec_decode_num_draft_tokens"]), whole


def test_a_draft_model_with_another_vocabulary_is_refused(tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    import json

    from kvpage.model.tiny_model import build_tiny_model, random_llama_tensors
    from safetensors.numpy import save_file

    draft = build_tiny_model(tmp_path / "draft")
    config = json.loads((draft / "config.json").read_text())
    config["vocab_size"] += 64  # another tokenizer's size
    (draft / "config.json").write_text(json.dumps(config))
    save_file(random_llama_tensors(config, 1), str(draft / "model.safetensors"))
    with pytest.raises(ValueError, match="share the target's tokenizer"):
        make_llm(tiny_model_dir, draft_model_spec(draft))


def test_drafts_longer_than_max_num_seqs_are_verified_in_one_step(
    tiny_model_dir: Path,
) -> None:
    """``num_speculative_tokens`` 7 with 4 seats: one sequence still verifies up to 7
    drafts a step (the heads take ``1 + num_speculative_tokens`` rows), losslessly."""
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    want = make_llm(tiny_model_dir, None).generate([PROMPTS[0]], params, use_tqdm=False)
    llm = make_llm(tiny_model_dir, {**SPEC, "num_speculative_tokens": 7})
    assert llm.engine.config.max_sampled_rows == 8
    runner = llm.engine.runner
    sampled: list[int] = []
    dispatch = runner.dispatch

    def counting(plan: Any, *args: Any, **kwargs: Any) -> Any:
        sampled.append(len(plan.sample_rows))
        return dispatch(plan, *args, **kwargs)

    runner.dispatch = counting
    got = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    assert max(sampled) > 4  # more sampled rows than seats
    assert llm.engine._ctx.scheduler.stats()["num_referenced_blocks"] == 0


def test_the_device_keeps_rows_while_drafts_agree() -> None:
    # Two sequences: one verifying drafts [7, 8] at tokens 10..12, one plain row at 20.
    tokens = np.zeros(32, np.int32)
    tokens[10:13] = [6, 7, 8]
    logits_indices = np.asarray([10, 11, 12, 20, 0, 0], np.int32)
    seats = np.asarray([2, 2, 2, 5, 0, 0], np.int32)
    offsets, drafts = draft_rows(tokens, logits_indices, seats, np.int32(4))
    assert list(offsets[:4]) == [0, 1, 2, 0]
    assert list(drafts[:4]) == [7, 8, -1, -1]
    kept = kept_rows(offsets, drafts, np.asarray([7, 9, 4, 1, 0, 0], np.int32))
    assert list(kept[:4]) == [True, True, False, True]  # 9 != 8 rejects row 2


def test_bad_speculative_configs_name_the_problem() -> None:
    assert parse_speculative_config(None) is None
    config = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3}')
    assert config == SpeculativeConfig(num_speculative_tokens=3)
    for bad, words in [
        ({"method": "eagle"}, "not supported yet"),
        ({"method": "draft_model"}, "needs \"model\""),
        ({"method": "ngram", "model": "x"}, "is for method"),
        ({"method": "medusa2"}, "supported methods"),
        ({"num_speculative_tokens": 3}, "needs a method"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"method": "ngram", "prompt_lookup_min": 5}, "exceeds"),
        ({"method": "ngram", "lookahead": 2}, "unknown keys"),
        ("{not json", "not valid JSON"),
        (7, "must be a dict"),
    ]:
        with pytest.raises(ValueError, match=words):
            parse_speculative_config(bad)
