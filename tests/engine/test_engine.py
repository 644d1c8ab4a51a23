"""End to end on CPU with a tiny random Llama: batching, preemption, prefix
caching, parallel sampling, aborts, stop strings and bad input."""

from __future__ import annotations

from pathlib import Path

import jax
import pytest
from kvpage import LLM, SamplingParams
from kvpage.engine.config import EngineConfig
from kvpage.engine.llm_engine import LLMEngine
from kvpage.engine.requests import Request

PROMPTS = [
    {"prompt_token_ids": [5, 17, 99, 3, 42, 7, 250, 11, 64]},
    {"prompt_token_ids": [8, 9]},
    {"prompt_token_ids": list(range(20, 61))},
    {"prompt_token_ids": [300, 301, 302, 303, 304, 305, 306]},
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make_llm(model: Path, **overrides: object) -> LLM:
    args: dict = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128, block_size=8)
    args.update(overrides)
    return LLM(str(model), **args)


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return make_llm(tiny_model_dir)


def tokens(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def assert_all_blocks_back(engine: LLMEngine) -> None:
    engine.check_invariants()
    assert engine.get_stats()["kv_cache_usage_perc"] == 0.0


def test_the_engine_runs_a_step_runner(llm: LLM) -> None:
    from kvpage.runner.protocol import StepRunner

    assert isinstance(llm.engine.runner, StepRunner)


def test_batched_greedy_equals_one_at_a_time(llm: LLM) -> None:
    together = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    alone = [tokens(llm.generate([p], GREEDY, use_tqdm=False))[0] for p in PROMPTS]
    assert together == alone
    assert all(len(t) == 12 for t in together)
    assert_all_blocks_back(llm.engine)


def test_outputs_come_back_in_input_order_with_metrics(llm: LLM) -> None:
    outputs = llm.generate(["Hello world", "The sky"], GREEDY, use_tqdm=False)
    assert [o.prompt for o in outputs] == ["Hello world", "The sky"]
    for out in outputs:
        assert out.finished and out.outputs[0].finish_reason == "length"
        assert out.metrics.time_to_first_token is not None and out.metrics.queue_time >= 0
        assert out.outputs[0].text != ""


def test_tiny_pool_forces_preemption_and_keeps_greedy_outputs(
    tiny_model_dir: Path, llm: LLM
) -> None:
    expected = tokens(llm.generate(PROMPTS, GREEDY, use_tqdm=False))
    small = make_llm(tiny_model_dir, num_gpu_blocks=10, max_model_len=64)
    got = tokens(small.generate(PROMPTS, GREEDY, use_tqdm=False))
    assert small.engine.get_stats()["num_preemptions"] > 0
    assert got == expected
    assert_all_blocks_back(small.engine)


def test_prefix_caching_hits_and_matches_uncached_outputs(tiny_model_dir: Path, llm: LLM) -> None:
    system = list(range(100, 140))
    prompts = [{"prompt_token_ids": system + [i, i + 1]} for i in (3, 9, 27)]
    llm.generate(prompts[:1], GREEDY, use_tqdm=False)
    cached = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert all(o.num_cached_tokens >= 32 for o in cached[1:])
    uncached_llm = make_llm(tiny_model_dir, enable_prefix_caching=False)
    uncached = uncached_llm.generate(prompts, GREEDY, use_tqdm=False)
    assert tokens(cached) == tokens(uncached)
    assert all(o.num_cached_tokens == 0 for o in uncached)


def test_reset_prefix_cache_forgets_every_prefix(llm: LLM) -> None:
    prompt = {"prompt_token_ids": list(range(200, 240)) + [5]}
    llm.generate([prompt], GREEDY, use_tqdm=False)
    assert llm.engine.get_stats()["num_cached_blocks"] > 0
    assert llm.generate([prompt], GREEDY, use_tqdm=False)[0].num_cached_tokens >= 32
    assert llm.reset_prefix_cache() is True
    assert llm.engine.get_stats()["num_cached_blocks"] == 0
    again = llm.generate([prompt], GREEDY, use_tqdm=False)[0]
    assert again.num_cached_tokens == 0
    assert_all_blocks_back(llm.engine)


def test_parallel_samples_share_the_prompt_and_are_seeded(llm: LLM) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=6, ignore_eos=True)
    first = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0]
    again = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in again.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1, "samples differ"
    assert_all_blocks_back(llm.engine)


def test_static_policy_samples_match_continuous_ones(tiny_model_dir: Path, llm: LLM) -> None:
    # Static batching gives every sample its own KV reservation: seeded samples read their
    # own context and equal those of continuous batching (forks sharing the prompt).
    params = SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True)
    static = make_llm(tiny_model_dir, scheduling_policy="static")
    got = static.generate(PROMPTS[:2], params, use_tqdm=False)
    want = llm.generate(PROMPTS[:2], params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in got] == [
        [c.token_ids for c in o.outputs] for o in want
    ]
    assert_all_blocks_back(static.engine)


def test_min_tokens_masks_stop_tokens_and_eos_on_the_device(llm: LLM) -> None:
    prompt = PROMPTS[0]
    first = tokens(llm.generate([prompt], GREEDY, use_tqdm=False))[0][0]
    greedy = dict(temperature=0.0, max_tokens=6, ignore_eos=True, stop_token_ids=[first])
    stopped = llm.generate([prompt], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0]
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) <= 1
    held = llm.generate([prompt], SamplingParams(**greedy, min_tokens=3), use_tqdm=False)
    out = held[0].outputs[0].token_ids
    assert len(out) >= 3 and first not in out[:3], "a stop token was sampled before min_tokens"
    # EOS is masked too (unless ignore_eos): leave one token besides EOS unmasked.
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    eos = set(engine.eos_token_ids)
    free = next(t for t in range(vocab) if t not in eos and t != first)
    others = [t for t in range(vocab) if t not in eos and t != free]
    params = SamplingParams(temperature=0.0, max_tokens=6, min_tokens=4, stop_token_ids=others)
    out = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    assert out[:4] == [free] * 4, out
    assert_all_blocks_back(engine)


def test_compilation_cache_stays_out_of_the_home_directory(
    llm: LLM, hermetic_compilation_cache: Path
) -> None:
    cache = Path(jax.config.jax_compilation_cache_dir).resolve()
    assert cache == hermetic_compilation_cache.resolve()
    assert not cache.is_relative_to(Path("~/.cache/kvpage").expanduser().resolve())


def test_abort_frees_every_block(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("long", PROMPTS[2], SamplingParams(max_tokens=100, ignore_eos=True))
    engine.add_request("waiting", PROMPTS[0], SamplingParams(max_tokens=100, ignore_eos=True))
    engine.step()
    engine.step()
    aborted = engine.abort_request(["long", "waiting", "unknown"])
    assert [o.request_id for o in aborted] == ["long", "waiting"]
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in aborted if o.outputs)
    assert not engine.has_unfinished_requests()
    assert_all_blocks_back(engine)


def test_stop_string_ends_the_sample_and_is_excluded(llm: LLM) -> None:
    free = llm.generate(["Hello world"], GREEDY, use_tqdm=False)[0].outputs[0].text
    stop = free[3:6]
    assert stop.strip(), "need a non-trivial stop string from the free-running text"
    out = llm.generate(
        ["Hello world"], SamplingParams(temperature=0.0, max_tokens=12, stop=[stop]), use_tqdm=False
    )[0]
    completion = out.outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == free[: free.index(stop)]
    assert_all_blocks_back(llm.engine)


def test_streaming_deltas_add_up_to_the_final_text(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("s", "Hello world", GREEDY, delta=True)
    pieces, ids = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            pieces.append(out.outputs[0].text)
            ids += out.outputs[0].token_ids
    full = llm.generate(["Hello world"], GREEDY, use_tqdm=False)[0].outputs[0]
    assert "".join(pieces) == full.text and ids == full.token_ids


def test_logprobs_are_returned_for_each_token(llm: LLM) -> None:
    out = llm.generate(
        PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3), use_tqdm=False
    )[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token in entry and entry[token].rank == 1 and len(entry) == 3
    assert out.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs, strict=True)), rel=1e-5
    )


def test_logprobs_mode_reaches_the_output(llm: LLM) -> None:
    """Seeded, the same tokens come out in every mode; the processed logits of the chosen
    token are its raw logits over the temperature."""

    def chosen(mode: str) -> tuple[list[int], list[float]]:
        params = SamplingParams(temperature=0.7, seed=3, max_tokens=5, ignore_eos=True,
                                logprobs=1, logprobs_mode=mode)
        out = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
        pairs = zip(out.token_ids, out.logprobs, strict=True)
        return list(out.token_ids), [entry[token].logprob for token, entry in pairs]

    raw_tokens, raw_logits = chosen("raw_logits")
    processed_tokens, processed_logits = chosen("processed_logits")
    assert raw_tokens == processed_tokens
    assert processed_logits == pytest.approx([v / 0.7 for v in raw_logits], rel=1e-5)
    raw_lp = chosen("raw_logprobs")[1]
    processed_lp = chosen("processed_logprobs")[1]
    assert all(lp <= 0 for lp in raw_lp + processed_lp) and raw_lp != processed_lp


def test_chat_uses_the_chat_template(llm: LLM) -> None:
    out = llm.chat([{"role": "user", "content": "hi"}], GREEDY, use_tqdm=False)[0]
    assert out.prompt == "<|user|>hi<|end|><|assistant|>"


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(n=0), "n"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(logprobs=-1), "logprobs"),
        (dict(prompt_logprobs=1.5), "prompt_logprobs"),
        (dict(logprobs_mode="softmax"), "logprobs_mode"),
        (dict(stop=[""]), "stop"),
        (dict(presence_penalty=float("nan")), "presence_penalty"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
    ],
)
def test_invalid_sampling_params_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_the_engine_max_logprobs_is_the_one_logprobs_limit(tiny_model_dir: Path) -> None:
    """``SamplingParams`` does not cap ``logprobs`` itself: an engine configured for
    more than 20 serves them, and its own limit names ``max_logprobs``."""
    llm = make_llm(tiny_model_dir, max_logprobs=24)
    params = SamplingParams(temperature=0.0, max_tokens=2, logprobs=24, ignore_eos=True)
    (out,) = llm.generate([PROMPTS[0]], params, use_tqdm=False)
    assert [len(entry) >= 24 for entry in out.outputs[0].logprobs] == [True, True]
    with pytest.raises(ValueError, match=r"logprobs must be <= 24 \(max_logprobs\)"):
        llm.engine.add_request("too-many", PROMPTS[0], SamplingParams(logprobs=25))
    assert_all_blocks_back(llm.engine)


def test_bad_requests_are_rejected_and_leave_the_engine_healthy(llm: LLM) -> None:
    engine = llm.engine
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request("too-long", {"prompt_token_ids": [1] * 129})
    # A prompt of max_model_len tokens gets its one sampled token (its KV is never needed).
    full = llm.generate([{"prompt_token_ids": [1] * 128}], GREEDY, use_tqdm=False)[0].outputs[0]
    assert len(full.token_ids) == 1 and full.finish_reason == "length"
    with pytest.raises(ValueError, match="min_tokens=20 cannot be reached: only 8 tokens fit"):
        engine.add_request("unreachable", {"prompt_token_ids": [1] * 120},
                           SamplingParams(min_tokens=20, max_tokens=None))
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("bad-id", {"prompt_token_ids": [1, 10**9]})
    with pytest.raises(ValueError, match="empty"):
        engine.add_request("empty", {"prompt_token_ids": []})
    engine.add_request("dup", PROMPTS[1], GREEDY)
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request("dup", PROMPTS[1], GREEDY)
    engine.abort_request("dup")
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)
    assert tokens(llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False))[0]
    assert_all_blocks_back(engine)


def test_overlapped_host_work_gives_the_same_outputs(tiny_model_dir: Path, llm: LLM) -> None:
    params = [GREEDY, SamplingParams(temperature=0.0, max_tokens=12, stop=["e"])] * 2
    overlapped = llm.generate(PROMPTS, params, use_tqdm=False)
    serial = make_llm(tiny_model_dir, overlap_host_work=False)
    plain = serial.generate(PROMPTS, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in overlapped] == [o.outputs[0].token_ids for o in plain]
    assert [o.outputs[0].text for o in overlapped] == [o.outputs[0].text for o in plain]
    timing = llm.engine.get_stats()["timing"]
    assert timing["steps"] > 0 and 0.0 <= timing["device_idle_fraction"] < 1.0
    assert_all_blocks_back(serial.engine)


def _fail_next_dispatch(engine: LLMEngine, lose_device_state: bool = False) -> None:
    runner = engine.runner

    def boom(plan: object, *args: object, **kwargs: object) -> object:
        # Back to the real methods after one failure (a small decode batch runs
        # several steps per call: dispatch_multi_step).
        del runner.dispatch, runner.dispatch_multi_step
        if lose_device_state:  # as if the failed executable consumed its donated pools
            for leaf in jax.tree_util.tree_leaves(runner.kv_pools):
                leaf.delete()
        raise RuntimeError("injected device fault")

    runner.dispatch = boom
    runner.dispatch_multi_step = boom


@pytest.mark.parametrize("lose_device_state", [False, True])
def test_failed_step_fails_its_requests_and_the_engine_keeps_serving(
    llm: LLM, lose_device_state: bool
) -> None:
    engine = llm.engine
    engine.add_request("r1", PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("r2", PROMPTS[1], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    _fail_next_dispatch(engine, lose_device_state)
    failed = engine.step()
    assert sorted(o.request_id for o in failed) == ["r1", "r2"]
    assert all(o.finished and "injected device fault" in o.error for o in failed)
    assert all(c.finish_reason == "error" for o in failed for c in o.outputs)
    assert not engine.has_unfinished_requests()
    assert_all_blocks_back(engine)
    after = llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False)[0]
    assert len(after.outputs[0].token_ids) == 12 and after.error is None


def test_non_finite_logits_fail_only_that_request(llm: LLM) -> None:
    engine = llm.engine
    engine.add_request("bad", PROMPTS[0], SamplingParams(max_tokens=20, ignore_eos=True))
    engine.add_request("good", PROMPTS[1], GREEDY)
    engine.step()
    runner, dispatch = engine.runner, engine.runner.dispatch

    class Poisoned:
        def __init__(self, plan: object, *args: object) -> None:
            self.plan, self.pending = plan, dispatch(plan, *args)

        def result(self) -> object:
            out = self.pending.result()
            bad = engine._requests["bad"].handle
            out.logprobs = out.logprobs.copy()  # device_get arrays are read-only
            out.logprobs[list(self.plan.sample_request).index(bad)] = float("nan")
            return out

    def poisoned(
        plan: object, prompt_targets: object = None, token_bitmask_fn: object = None
    ) -> object:
        del runner.dispatch
        return Poisoned(plan, prompt_targets, token_bitmask_fn)

    runner.dispatch = poisoned
    outputs: dict[str, object] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] = out
    assert outputs["bad"].error and "non-finite" in outputs["bad"].error
    assert outputs["good"].error is None
    assert len(outputs["good"].outputs[0].token_ids) == 12
    assert_all_blocks_back(engine)


def test_seats_come_from_the_plan_and_the_engine_keeps_none(tiny_model_dir: Path) -> None:
    """The scheduler owns seats (sampling-table rows): every sampled row's seat is
    bound once per admission, loaded with ``set_request`` before its first step,
    kept until freed, and never shared; preemption, n > 1, stop strings and aborts
    included. The engine holds no seat state of its own."""
    llm = make_llm(tiny_model_dir, num_gpu_blocks=10, max_model_len=64, max_num_seqs=4)
    engine, runner = llm.engine, llm.engine.runner
    owner: dict[int, tuple[int, int]] = {}
    loaded: set[int] = set()
    set_request, free_request, dispatch = runner.set_request, runner.free_request, runner.dispatch

    def recording_set_request(seat: int, *args: object) -> None:
        loaded.add(seat)
        set_request(seat, *args)

    def recording_free_request(seat: int) -> None:
        assert seat in owner, f"seat {seat} freed but not held"
        del owner[seat]
        free_request(seat)

    def recording_dispatch(plan: object, **kwargs: object) -> object:
        seats = plan.sample_rows.tolist()
        assert len(set(seats)) == len(seats), "a seat appears twice in one plan"
        for seat, h, i, new in zip(
            seats, plan.sample_request.tolist(), plan.sample_index.tolist(),
            plan.sample_new_seat.tolist(), strict=True,
        ):
            if new:
                assert seat not in owner, f"seat {seat} rebound before it was freed"
                assert seat in loaded, f"seat {seat} dispatched before set_request"
                owner[seat] = (h, i)
            else:
                assert owner[seat] == (h, i), "a sample changed seats without a new binding"
        loaded.clear()
        return dispatch(plan, **kwargs)

    runner.set_request = recording_set_request
    runner.free_request = recording_free_request
    runner.dispatch = recording_dispatch
    try:
        params = SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=10, ignore_eos=True)
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"r{i}", prompt, params if i % 2 else GREEDY)
        engine.step()
        engine.step()
        engine.abort_request("r0")
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        del runner.set_request, runner.free_request, runner.dispatch
    assert engine.get_stats()["num_preemptions"] > 0
    assert not any("slot" in name or "seat" in name for name in vars(engine))
    assert not any("slot" in name or "seat" in name for name in Request.__slots__)
    assert_all_blocks_back(engine)


def _stream_all(engine: LLMEngine, params: list[SamplingParams], delta: bool) -> dict:
    """Every output of every request, stepped to the end: request id -> outputs."""
    for i, (prompt, p) in enumerate(zip(PROMPTS, params, strict=True)):
        engine.add_request(f"t{i}", prompt, p, delta=delta)
    seen: dict = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            seen.setdefault(out.request_id, []).append(
                (out.finished, [
                    (c.index, c.text, list(c.token_ids), c.finish_reason, c.stop_reason,
                     # (rounded: a prefix-cache hit may move logits by float noise)
                     None if c.cumulative_logprob is None else round(c.cumulative_logprob, 3),
                     None if c.logprobs is None else len(c.logprobs))
                    for c in out.outputs
                ])
            )
    return seen


def test_python_detokenization_streams_the_same_outputs_as_the_rust_core(llm: LLM) -> None:
    """Tokenizers the Rust core cannot load stream through the Python twin of the
    output streams: same deltas, tokens, stop strings, logprobs, samples."""
    engine = llm.engine
    free = llm.generate(["Hello world"], GREEDY, use_tqdm=False)[0].outputs[0].text
    params = [
        SamplingParams(temperature=0.0, max_tokens=10, stop=[free[4:6]]),
        SamplingParams(temperature=0.8, seed=5, n=2, max_tokens=8, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, stop=["e", "a"]),
        GREEDY,
    ]
    for delta in (True, False):
        rust = _stream_all(engine, params, delta)
        engine.rust_detokenization = False
        try:
            python = _stream_all(engine, params, delta)
            python_streams = engine._outputs.python_streams
            assert python_streams is not None and len(python_streams) == 0
        finally:
            engine.rust_detokenization = True
        assert {k.replace("t", ""): v for k, v in rust.items()} == {
            k.replace("t", ""): v for k, v in python.items()
        }
    assert_all_blocks_back(engine)


def test_streamed_logprobs_add_up_to_the_final_ones(llm: LLM) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=2)
    engine = llm.engine
    engine.add_request("lp", PROMPTS[0], params, delta=True)
    ids, logprobs = [], []
    while engine.has_unfinished_requests():
        for out in engine.step():
            ids += out.outputs[0].token_ids
            logprobs += out.outputs[0].logprobs
            assert len(out.outputs[0].logprobs) == len(out.outputs[0].token_ids)
    final = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0]
    assert ids == final.token_ids and logprobs == final.logprobs
