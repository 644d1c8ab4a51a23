"""Multi-step decode (``num_scheduler_steps``): a small decode batch runs several steps
in one device call (:mod:`kvpage.runner.multi_step`), and the engine replays them through
the scheduler (``lookahead_steps`` / ``schedule_continuation``). Outputs must equal the
one-step-per-call engine's, token for token, whatever finishes mid-call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import pytest
from kvpage import LLM, EngineConfig, SamplingParams

PROMPTS: list[Any] = [
    {"prompt_token_ids": [5, 17, 99, 3, 42, 7, 250, 11, 64]},
    {"prompt_token_ids": [8, 9]},
    {"prompt_token_ids": list(range(20, 61))},
]


def make_llm(model: Path, steps: int) -> LLM:
    return LLM(
        str(model), max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
        block_size=8, num_scheduler_steps=steps, warmup="full" if steps > 1 else "none",
    )


@pytest.fixture(scope="module")
def engines(tiny_model_dir: Path) -> tuple[LLM, LLM]:
    return make_llm(tiny_model_dir, 1), make_llm(tiny_model_dir, 4)


def run_all(llm: LLM) -> list[Any]:
    """Every kind of row a lookahead must get right, one at a time and batched."""
    free = llm.generate([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=20),
                        use_tqdm=False)[0].outputs[0]
    cases: list[tuple[list[Any], Any]] = [
        # One row; max_tokens ends mid-call (21 is not a multiple of 4).
        ([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True)),
        # Rows that finish at different steps inside one call.
        (PROMPTS, [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
                   for m in (3, 10, 17)]),
        # A stop string found by the host after the device ran past it.
        ([PROMPTS[0]], SamplingParams(temperature=0.0, max_tokens=20, stop=[free.text[5:8]])),
        # A stop token id, and seeded sampling with logprobs (the device's RNG and counts).
        ([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=20,
                                      stop_token_ids=[free.token_ids[6]])),
        (PROMPTS[:2], SamplingParams(temperature=0.9, seed=3, max_tokens=15, logprobs=2,
                                     ignore_eos=True)),
        # Parallel samples (forked rows decode together).
        ([PROMPTS[2]], SamplingParams(temperature=0.8, seed=11, n=2, max_tokens=9,
                                      ignore_eos=True)),
    ]
    results = []
    for prompts, params in cases:
        for out in llm.generate(prompts, params, use_tqdm=False):
            for c in out.outputs:
                top = None
                if c.logprobs is not None:
                    top = [sorted(entry) for entry in c.logprobs]
                results.append((list(c.token_ids), c.text, c.finish_reason, top))
    return results


def test_multi_step_outputs_equal_one_step_per_call(engines: tuple[LLM, LLM]) -> None:
    single, multi = engines
    assert single.engine.runner.num_scheduler_steps == 1
    buckets = multi.engine.runner.multi_step.buckets()
    assert buckets and buckets[0] == 1 and buckets[-1] == 4
    expected = run_all(single)
    calls_before = multi.engine.counters.get("multi_step_calls", 0)
    assert run_all(multi) == expected
    assert multi.engine.counters["multi_step_calls"] > calls_before
    for llm in engines:
        llm.engine.check_invariants()
        assert llm.engine.get_stats()["kv_cache_usage_perc"] == 0.0


def test_logprob_values_match_one_step_per_call(engines: tuple[LLM, LLM]) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=3, ignore_eos=True)
    single, multi = (llm.generate(PROMPTS[:2], params, use_tqdm=False) for llm in engines)
    for a, b in zip(single, multi, strict=True):
        for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert lp_a.keys() == lp_b.keys()
            for token in lp_a:
                assert lp_a[token].logprob == pytest.approx(lp_b[token].logprob, abs=1e-5)


def test_a_failed_multi_step_call_fails_its_requests_only(engines: tuple[LLM, LLM]) -> None:
    _, llm = engines
    engine, runner = llm.engine, llm.engine.runner

    def boom(plan: object, num_steps: int) -> object:
        del runner.dispatch_multi_step  # the real method again after one failure
        raise RuntimeError("injected device fault")

    engine.add_request("a", PROMPTS[0], SamplingParams(max_tokens=30, ignore_eos=True))
    while engine.counters.get("steps", 0) == 0 or not engine.scheduler.num_requests_running:
        engine.step()
    engine.step()  # the prompt is done: decode steps from here
    runner.dispatch_multi_step = boom
    failed = engine.step()
    assert [o.request_id for o in failed] == ["a"] and "injected device fault" in failed[0].error
    assert not engine.has_unfinished_requests()
    engine.check_invariants()
    assert engine.get_stats()["kv_cache_usage_perc"] == 0.0
    after = llm.generate([PROMPTS[1]], SamplingParams(temperature=0.0, max_tokens=9),
                         use_tqdm=False)[0]
    assert after.error is None and len(after.outputs[0].token_ids) >= 1


def test_num_scheduler_steps_is_validated() -> None:
    with pytest.raises(ValueError, match="num_scheduler_steps"):
        EngineConfig(model="m", num_scheduler_steps=0)


def test_multi_step_decode_without_a_device_equals_one_step_per_call() -> None:
    """The engine's side of multi-step decode (lookahead, continuation replay, rows that
    finish mid-call) over the benchmarks' instant runner, a ``StepRunner`` with no device:
    the same tokens and texts as one step per call."""
    from kvpage.bench.host import TEXT, InstantRunner, load_tokenizer_and_config
    from kvpage.engine.llm_engine import LLMEngine
    from kvpage.runner.protocol import StepRunner

    tokenizer, model_config = load_tokenizer_and_config()

    def run(steps: int) -> tuple[dict[str, Any], int]:
        config = EngineConfig(max_num_seqs=4, max_model_len=128, num_gpu_blocks=64,
                              compilation_cache_dir=None)
        runner = InstantRunner(64, config.block_size, 128, 4, tokenizer(TEXT)["input_ids"],
                               num_scheduler_steps=steps)
        assert isinstance(runner, StepRunner)
        engine = LLMEngine(config, model_config, None, tokenizer, runner=runner)
        for i in range(6):
            engine.add_request(f"r{i}", [5 + i] * (3 + i),
                               SamplingParams(max_tokens=5 + 3 * i, ignore_eos=True))
        done: dict[str, Any] = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = (out.outputs[0].token_ids, out.outputs[0].text)
        engine.check_invariants()
        return done, int(engine.counters.get("multi_step_calls", 0))

    single, _ = run(1)
    multi, calls = run(4)
    assert calls > 0 and len(single) == 6
    assert multi == single


def test_a_sink_gets_a_call_s_deltas_while_the_next_multi_step_call_runs(
    engines: tuple[LLM, LLM],
) -> None:
    _, multi = engines
    engine = multi.engine
    events: list[tuple[str, str, list[int]]] = []  # (where, text, token ids), in order

    def record(where: str, outputs: list[Any]) -> None:
        events.extend((where, o.outputs[0].text, list(o.outputs[0].token_ids)) for o in outputs)

    params = SamplingParams(temperature=0.0, max_tokens=21, ignore_eos=True)
    engine.set_overlapped_output_sink(lambda outputs: record("sink", outputs))
    try:
        engine.add_request("early", PROMPTS[0], params, delta=True)
        while engine.has_unfinished_requests():
            record("step", engine.step())
    finally:
        engine.set_overlapped_output_sink(None)
    full = multi.generate([PROMPTS[0]], params, use_tqdm=False)[0].outputs[0]
    assert "".join(text for _, text, _ in events) == full.text
    assert [t for _, _, ids in events for t in ids] == full.token_ids
    # The prompt's first token and the calls' tokens went out during the next call.
    assert events[0][0] == "sink" and events[0][2] == full.token_ids[:1]
    assert [where for where, _, _ in events].count("sink") >= 21 // 4
