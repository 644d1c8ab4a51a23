"""SamplingParams.prompt_logprobs: scored in the prefill's forward pass, equal to a float64
reference, the same chunked or not, with the prefix cache on, and free for other requests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvpage import LLM, SamplingParams
from kvpage.outputs import RequestOutput

PROMPT = [5, 17, 99, 3, 42, 7, 250, 11, 64, 120, 121, 122, 33, 34, 35, 36, 200, 201, 202]
K = 3


def make_llm(model: Path, **overrides: object) -> LLM:
    args: dict = dict(
        max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, block_size=4,
        compilation_cache_dir=None,
    )
    args.update(overrides)
    return LLM(str(model), **args)


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return make_llm(tiny_model_dir, enable_prefix_caching=False)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> np.ndarray:
    """float64 log-softmax of the HF (transformers) forward over PROMPT: [len, vocab]."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(tiny_model_dir), dtype=torch.float64, local_files_only=True
    ).eval()
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0]
    return torch.log_softmax(logits, dim=-1).numpy()


def score(llm: LLM, prompt: list[int] = PROMPT, k: int = K, **params: Any) -> RequestOutput:
    params = {"temperature": 0.0, "max_tokens": 2, **params}
    sampling = SamplingParams(prompt_logprobs=k, **params)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], sampling, use_tqdm=False)
    return out


def as_arrays(out: RequestOutput, prompt: list[int] = PROMPT) -> tuple[np.ndarray, ...]:
    """(logprob of each prompt token 1.., its rank, top-K ids, top-K logprobs)."""
    pl = out.prompt_logprobs
    assert pl is not None and len(pl) == len(prompt) and pl[0] is None
    lps, ranks, top_ids, top_lps = [], [], [], []
    for token, entry in zip(prompt[1:], pl[1:], strict=True):
        assert entry is not None and token in entry
        lps.append(entry[token].logprob)
        ranks.append(entry[token].rank)
        top = sorted((lp.rank, t, lp.logprob) for t, lp in entry.items() if lp.rank <= K)
        top_ids.append([t for _, t, _ in top])
        top_lps.append([lp for _, _, lp in top])
    return np.array(lps), np.array(ranks), np.array(top_ids), np.array(top_lps)


def assert_all_blocks_back(llm: LLM) -> None:
    llm.engine.check_invariants()
    assert llm.engine.get_stats()["kv_cache_usage_perc"] == 0.0


def test_matches_float64_reference(llm: LLM, reference: np.ndarray) -> None:
    lps, ranks, top_ids, top_lps = as_arrays(score(llm))
    rows = reference[:-1]  # position p predicts token p + 1
    targets = np.array(PROMPT[1:])
    want = rows[np.arange(len(targets)), targets]
    np.testing.assert_allclose(lps, want, atol=2e-5)
    np.testing.assert_array_equal(ranks, 1 + (rows > want[:, None]).sum(axis=1))
    order = np.argsort(-rows, axis=1)[:, :K]
    np.testing.assert_array_equal(top_ids, order)
    np.testing.assert_allclose(top_lps, np.take_along_axis(rows, order, axis=1), atol=2e-5)
    assert_all_blocks_back(llm)


def test_chunked_prefill_gives_the_same_numbers(tiny_model_dir: Path, llm: LLM) -> None:
    whole = as_arrays(score(llm))
    chunked_llm = make_llm(tiny_model_dir, enable_prefix_caching=False,
                           max_num_batched_tokens=8, max_num_seqs=4)
    chunked = score(chunked_llm)
    # the 19-token prompt needed three steps
    assert chunked_llm.engine.counters["steps"] >= 3
    for a, b in zip(whole, as_arrays(chunked), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert_all_blocks_back(chunked_llm)


def test_prefix_cache_is_bypassed_with_identical_numbers(tiny_model_dir: Path, llm: LLM) -> None:
    expected = as_arrays(score(llm))
    cached = make_llm(tiny_model_dir, enable_prefix_caching=True)
    plain = SamplingParams(temperature=0.0, max_tokens=2)
    warm = cached.generate([{"prompt_token_ids": PROMPT}], plain, use_tqdm=False)[0]
    again = cached.generate([{"prompt_token_ids": PROMPT}], plain, use_tqdm=False)[0]
    assert warm.num_cached_tokens == 0 and again.num_cached_tokens >= 16  # the cache works
    out = score(cached)
    assert out.num_cached_tokens == 0  # this request computed (and scored) every position
    for a, b in zip(expected, as_arrays(out), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    # and it did not disturb the cache for everyone else
    after = cached.generate([{"prompt_token_ids": PROMPT}], plain, use_tqdm=False)[0]
    assert after.num_cached_tokens >= 16
    assert after.outputs[0].token_ids == again.outputs[0].token_ids
    assert_all_blocks_back(cached)


def test_batched_with_plain_requests(llm: LLM) -> None:
    """Scoring rows ride along with other requests; neither changes the other."""
    expected = as_arrays(score(llm))
    plain = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    others = [list(range(30, 45)), [7, 8, 9]]
    alone = [o.outputs[0].token_ids for o in llm.generate(
        [{"prompt_token_ids": p} for p in others], plain, use_tqdm=False)]
    scoring = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, prompt_logprobs=K)
    outs = llm.generate(
        [{"prompt_token_ids": others[0]}, {"prompt_token_ids": PROMPT},
         {"prompt_token_ids": others[1]}],
        [plain, scoring, plain], use_tqdm=False,
    )
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == alone
    assert outs[0].prompt_logprobs is None and outs[2].prompt_logprobs is None
    for a, b in zip(expected, as_arrays(outs[1]), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert_all_blocks_back(llm)


def test_plain_steps_never_compile_the_scoring_variant(tiny_model_dir: Path) -> None:
    fresh = make_llm(tiny_model_dir)
    fresh.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=3), use_tqdm=False)
    assert fresh.engine.runner.executables.compiled_scoring_buckets == []
    score(fresh)
    assert fresh.engine.runner.executables.compiled_scoring_buckets


def test_zero_k_n_samples_and_short_prompts(llm: LLM) -> None:
    out = score(llm, k=0, n=2, seed=3, temperature=1.0)
    assert len(out.outputs) == 2
    assert all(len(e) == 1 and tok in e for tok, e in zip(PROMPT[1:], out.prompt_logprobs[1:],
                                                          strict=True))
    one = score(llm, prompt=[42])
    assert one.prompt_logprobs == [None]
    assert_all_blocks_back(llm)


def test_streaming_deltas_carry_them_once(llm: LLM) -> None:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    engine.add_request("stream", {"prompt_token_ids": PROMPT}, params, delta=True)
    seen = []
    while engine.has_unfinished_requests():
        seen += [o.prompt_logprobs for o in engine.step()]
    carried = [p for p in seen if p is not None]
    assert len(carried) == 1 and len(carried[0]) == len(PROMPT)
    assert seen[0] is carried[0]  # with the first output
    assert_all_blocks_back(llm)


@pytest.mark.parametrize("value", [-1, 1.5, True])
def test_bad_values_name_the_field(value: object) -> None:
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value)  # type: ignore[arg-type]


def test_engine_limit_names_the_field(tiny_model_dir: Path) -> None:
    small = make_llm(tiny_model_dir, max_logprobs=2)
    with pytest.raises(ValueError, match=r"prompt_logprobs must be <= 2 \(max_logprobs\)"):
        score(small, k=3)


def test_tensor_parallel_gives_the_same_numbers(tiny_model_dir: Path, llm: LLM) -> None:
    expected = as_arrays(score(llm))
    sharded = make_llm(tiny_model_dir, enable_prefix_caching=False, tensor_parallel_size=2)
    for a, b in zip(expected, as_arrays(score(sharded)), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    assert_all_blocks_back(sharded)


def test_chunks_without_targets_skip_the_projection(tiny_model_dir: Path, llm: LLM) -> None:
    """A long plain prompt fills the step's first 128-row scoring chunk (skipped: no
    target in it); the scoring request's tokens land in the next chunk."""
    expected = as_arrays(score(llm))
    wide = make_llm(tiny_model_dir, enable_prefix_caching=False, max_num_batched_tokens=256,
                    max_model_len=512)
    long_prompt = [(7 * i) % 400 + 10 for i in range(200)]
    plain = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    scoring = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=K)
    outs = wide.generate([{"prompt_token_ids": long_prompt}, {"prompt_token_ids": PROMPT}],
                         [plain, scoring], use_tqdm=False)
    assert wide.engine.counters["steps"] == 3  # both prompts prefilled in one 219-token step
    for a, b in zip(expected, as_arrays(outs[1]), strict=True):
        np.testing.assert_allclose(a, b, atol=1e-5)
    alone = wide.generate([{"prompt_token_ids": long_prompt}], plain, use_tqdm=False)[0]
    assert outs[0].outputs[0].token_ids == alone.outputs[0].token_ids
    assert_all_blocks_back(wide)
