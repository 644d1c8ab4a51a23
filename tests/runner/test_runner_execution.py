"""ModelRunner: padding invariance, copy-on-write, compile counts, seeds, penalties, params."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import numpy as np
import pytest
from kvpage.model import ModelConfig, load_model
from kvpage.runner import ModelRunner, StepOutput, StepPlan
from kvpage.runner.layered_step import layer_groups
from kvpage.sampling import DeviceSamplingParams
from model_fixtures import (
    PlainPlanner,
    build_hf_model,
    generate,
    hf_logits,
    save_hf_model,
)

PROMPTS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36]]


def make_runner(config: ModelConfig, params: Any, **overrides: Any) -> ModelRunner:
    kwargs: dict[str, Any] = dict(
        num_blocks=48,
        block_size=4,
        max_model_len=64,
        max_num_seqs=8,
        token_buckets=(16,),
        seq_buckets=(4,),
        max_logprobs=3,
    )
    kwargs.update(overrides)
    return ModelRunner(config, params, **kwargs)


@pytest.fixture(scope="module")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny HF Llama (reference logits) and its weights loaded by kvpage."""
    model = build_hf_model("llama", seed=11)
    directory = save_hf_model(model, Path(tmp_path_factory.mktemp("runner")))
    config, params = load_model(directory)
    return model, config, params


@pytest.fixture(scope="module")
def config(hf_model: Any) -> ModelConfig:
    return hf_model[1]


@pytest.fixture(scope="module")
def params(hf_model: Any) -> Any:
    return hf_model[2]


@pytest.fixture(scope="module")
def runner(config: ModelConfig, params: Any) -> ModelRunner:
    runner = make_runner(config, params)
    runner.warmup(progress=False)
    return runner


def test_warmup_compiles_every_bucket_once(runner: ModelRunner) -> None:
    assert runner.executables.compiled_buckets == sorted(runner.executables.warmup_buckets())
    # per bucket embed, layer-group and logits pieces; a sampler per sequence bucket; the
    # seat writer and the stand-alone block copier (kvpage.runner.layered_step); a
    # multi-step decode executable per small sequence bucket (kvpage.runner.multi_step)
    buckets = runner.executables.warmup_buckets()
    samplers = {seqs for _, seqs, _ in buckets}
    pieces = 2 + len({n for _, n in layer_groups(runner.config.num_layers)})
    multi = len(runner.multi_step.buckets())
    assert runner.executables.num_compilations == pieces * len(buckets) + len(samplers) + 2 + multi


def test_padding_does_not_change_outputs(
    runner: ModelRunner, config: ModelConfig, params: Any
) -> None:
    wide = make_runner(config, params, token_buckets=(32,), seq_buckets=(8,))
    results = []
    for r in (runner, wide):
        outputs: list[tuple[StepPlan, StepOutput]] = []
        sampling = [DeviceSamplingParams(temperature=0.0, logprobs=3)] * len(PROMPTS)
        tokens = generate(
            r, PROMPTS, 6, sampling, outputs=outputs, token_budget=12, chunk_size=5, seed=1
        )
        results.append((tokens, outputs, r))
    (tokens_a, outs_a, ra), (tokens_b, outs_b, rb) = results
    assert tokens_a == tokens_b
    for (_, a), (_, b) in zip(outs_a, outs_b, strict=True):
        np.testing.assert_array_equal(a.sampled_token_ids, b.sampled_token_ids)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
        np.testing.assert_array_equal(a.top_token_ids, b.top_token_ids)
    # The real blocks of the KV cache agree too (the scratch block may differ).
    for (ka, va), (kb, vb) in zip(ra.kv_pools, rb.kv_pools, strict=True):
        n = ra.num_blocks
        np.testing.assert_allclose(np.asarray(ka)[:, :n], np.asarray(kb)[:, :n], atol=1e-5)
        np.testing.assert_allclose(np.asarray(va)[:, :n], np.asarray(vb)[:, :n], atol=1e-5)


def _prefill(runner: ModelRunner, seat: int, prompt: list[int], blocks: list[int]) -> int:
    """Prefill ``prompt`` into ``blocks``; returns the greedy next token."""
    bs = runner.block_size
    n = len(prompt)
    positions = np.arange(n, dtype=np.int32)
    table = np.asarray([blocks], np.int32)
    plan = StepPlan(
        token_ids=np.asarray(prompt, np.int32),
        positions=positions,
        slot_mapping=table[0, positions // bs] * bs + positions % bs,
        cu_q_lens=np.asarray([0, n], np.int32),
        kv_lens=np.asarray([n], np.int32),
        block_tables=table,
        logits_indices=np.asarray([n - 1], np.int32),
        sample_rows=np.asarray([seat], np.int32),
    )
    runner.set_request(seat, DeviceSamplingParams(temperature=0.0, logprobs=1), prompt)
    return int(runner.execute(plan).sampled_token_ids[0])


def _decode(
    runner: ModelRunner,
    token: int,
    position: int,
    tables: list[list[int]],
    seats: list[int],
    copy_src: list[int],
    copy_dst: list[int],
) -> StepOutput:
    bs = runner.block_size
    s = len(tables)
    table = np.asarray(tables, np.int32)
    slot_mapping = table[:, position // bs] * bs + position % bs
    plan = StepPlan(
        token_ids=np.full(s, token, np.int32),
        positions=np.full(s, position, np.int32),
        slot_mapping=slot_mapping.astype(np.int32),
        cu_q_lens=np.arange(s + 1, dtype=np.int32),
        kv_lens=np.full(s, position + 1, np.int32),
        block_tables=table,
        logits_indices=np.arange(s, dtype=np.int32),
        sample_rows=np.asarray(seats, np.int32),
        copy_src=np.asarray(copy_src, np.int32),
        copy_dst=np.asarray(copy_dst, np.int32),
    )
    return runner.execute(plan)


def test_copy_on_write_forks_share_history(config: ModelConfig, params: Any) -> None:
    runner = make_runner(config, params, max_fused_copies=2)
    greedy = DeviceSamplingParams(temperature=0.0, logprobs=1)
    prompt = PROMPTS[0][:10]  # blocks 5, 9 full; block 2 holds 2 tokens
    token = _prefill(runner, 0, prompt, [5, 9, 2])
    for seat in (1, 2, 3):
        runner.set_request(seat, greedy, prompt)

    def k_pool() -> np.ndarray:
        return np.asarray(runner.kv_pools[1][0])

    # Fork 1 without its copy reads an empty block: a different result (control).
    bad = _decode(runner, token, 10, [[5, 9, 2], [5, 9, 30]], [0, 1], [], [])
    assert not np.isclose(bad.logprobs[0], bad.logprobs[1], atol=1e-4)

    # Rewind: re-prefill, then two forks get private copies of the partial block 2
    # inside the step (2 copies <= max_fused_copies).
    token = _prefill(runner, 0, prompt, [5, 9, 2])
    assert not np.array_equal(k_pool()[:, 7, :2], k_pool()[:, 2, :2])
    out = _decode(runner, token, 10, [[5, 9, 2], [5, 9, 7], [5, 9, 11]], [0, 1, 2],
                  [2, 2], [7, 11])
    assert len(set(out.sampled_token_ids.tolist())) == 1
    np.testing.assert_allclose(out.logprobs, out.logprobs[0], atol=1e-6)
    np.testing.assert_array_equal(k_pool()[:, 7, :3], k_pool()[:, 2, :3])
    np.testing.assert_array_equal(k_pool()[:, 11, :3], k_pool()[:, 2, :3])

    # More copies than max_fused_copies run in a separate call before the step.
    next_token = int(out.sampled_token_ids[0])
    dst = list(range(20, 29))
    assert not np.array_equal(k_pool()[:, 28, :3], k_pool()[:, 2, :3])
    out = _decode(runner, next_token, 11, [[5, 9, 2], [5, 9, 20], [5, 9, 28]], [0, 1, 3],
                  [2] * len(dst), dst)
    assert len(set(out.sampled_token_ids.tolist())) == 1
    np.testing.assert_allclose(out.logprobs, out.logprobs[0], atol=1e-6)
    for block in dst[1:-1]:
        np.testing.assert_array_equal(k_pool()[:, block, :3], k_pool()[:, 2, :3])


def test_compile_count_fixed_after_warmup(runner: ModelRunner) -> None:
    before = runner.executables.num_compilations
    variants = [
        DeviceSamplingParams(temperature=0.0),
        DeviceSamplingParams(temperature=0.9, top_k=5, top_p=0.8, seed=3, logprobs=2),
        DeviceSamplingParams(temperature=1.2, min_p=0.1, presence_penalty=0.5,
                             frequency_penalty=0.3),
        DeviceSamplingParams(temperature=0.0, repetition_penalty=1.3, logprobs=3),
    ]
    for i, sampling in enumerate(variants):
        prompts = PROMPTS[: 1 + i % 3]
        generate(runner, prompts, 3 + i, sampling, token_budget=16 - i, chunk_size=4 + i)
    # CoW copies within and beyond the fused limit go through precompiled paths too.
    _prefill(runner, 0, PROMPTS[0][:10], [5, 9, 2])
    runner.set_request(1, DeviceSamplingParams(temperature=0.5), PROMPTS[0][:10])
    _decode(runner, 1, 10, [[5, 9, 2], [5, 9, 7]], [0, 1], [2] * 9, [7] * 9)
    assert runner.executables.num_compilations == before
    assert runner.executables.compiled_buckets == sorted(runner.executables.warmup_buckets())


def test_seeded_request_ignores_batch_composition(runner: ModelRunner) -> None:
    seeded = DeviceSamplingParams(temperature=1.0, top_p=0.95, seed=77)
    alone = generate(runner, [PROMPTS[1]], 10, [seeded], slots=[5])[0]
    others = [DeviceSamplingParams(temperature=0.7), DeviceSamplingParams(temperature=1.5, top_k=4)]
    together = generate(
        runner,
        [PROMPTS[0], PROMPTS[1], PROMPTS[2]],
        10,
        [others[0], seeded, others[1]],
        slots=[3, 0, 6],
        token_budget=14,
        chunk_size=6,
    )[1]
    assert alone == together
    # Seeds are 64-bit: one differing only in the high word gives other draws.
    high = DeviceSamplingParams(temperature=1.0, top_p=0.95, seed=77 + (1 << 32))
    assert generate(runner, [PROMPTS[1]], 10, [high])[0] != alone


def test_unseeded_sampling_varies(runner: ModelRunner) -> None:
    sampling = DeviceSamplingParams(temperature=1.5)
    first = generate(runner, [PROMPTS[2]], 8, [sampling])[0]
    second = generate(runner, [PROMPTS[2]], 8, [sampling])[0]
    assert first != second


@pytest.mark.parametrize(
    "sampling",
    [
        DeviceSamplingParams(temperature=0.0, repetition_penalty=1.8),
        DeviceSamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.7),
        DeviceSamplingParams(
            temperature=0.0, repetition_penalty=0.7, presence_penalty=-0.5, frequency_penalty=0.4
        ),
    ],
)
def test_penalties_match_reference_greedy(
    hf_model: Any, runner: ModelRunner, sampling: DeviceSamplingParams
) -> None:
    model = hf_model[0]
    prompt = [5, 6, 7, 5, 6, 7, 100, 101]
    got = generate(runner, [prompt], 12, [sampling], token_budget=16)[0]

    tokens = list(prompt)
    for _ in range(12):
        logits = hf_logits(model, tokens)[-1].astype(np.float64)
        output = tokens[len(prompt) :]
        counts = np.bincount(output, minlength=logits.size) if output else np.zeros(logits.size)
        seen = (counts > 0) | np.isin(np.arange(logits.size), prompt)
        rep = sampling.repetition_penalty
        logits = np.where(seen, np.where(logits > 0, logits / rep, logits * rep), logits)
        logits = logits - sampling.frequency_penalty * counts
        logits = logits - sampling.presence_penalty * (counts > 0)
        tokens.append(int(np.argmax(logits)))
    assert got == tokens[len(prompt) :]


def test_set_request_resumes_penalty_state(runner: ModelRunner) -> None:
    sampling = DeviceSamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.7)
    prompt = [9, 8, 7, 6]
    full = generate(runner, [prompt], 10, [sampling])[0]
    first = full[:4]
    # Resume after "preemption": re-prefill prompt + first outputs, state rebuilt.
    planner = PlainPlanner(runner.num_blocks, runner.block_size, token_budget=16)
    runner.set_request(0, sampling, prompt, first)
    seq = planner.add(0, prompt + first, 6)
    while (plan := planner.next_plan()) is not None:
        planner.commit(plan, runner.execute(plan).sampled_token_ids)
    assert first + seq.generated == full


def test_update_params_swaps_weights_without_recompiling(
    runner: ModelRunner, config: ModelConfig, params: Any
) -> None:
    before_tokens = generate(runner, [PROMPTS[0]], 6)[0]
    compilations = runner.executables.num_compilations
    runner.update_params(jax.tree_util.tree_map(lambda x: x * 1.5, params))
    try:
        assert generate(runner, [PROMPTS[0]], 6)[0] != before_tokens
        assert runner.executables.num_compilations == compilations
        with pytest.raises(ValueError):
            runner.update_params(
                jax.tree_util.tree_map(lambda x: x.astype(jax.numpy.bfloat16), params)
            )
    finally:
        runner.update_params(params)
    assert generate(runner, [PROMPTS[0]], 6)[0] == before_tokens


def _simple_plan(**changes: Any) -> StepPlan:
    fields: dict[str, Any] = dict(
        token_ids=np.asarray([1, 2, 3], np.int32),
        positions=np.asarray([0, 1, 2], np.int32),
        slot_mapping=np.asarray([0, 1, 2], np.int32),
        cu_q_lens=np.asarray([0, 3], np.int32),
        kv_lens=np.asarray([3], np.int32),
        block_tables=np.asarray([[0]], np.int32),
        logits_indices=np.asarray([2], np.int32),
        sample_rows=np.asarray([0], np.int32),
    )
    fields.update(changes)
    return StepPlan(**fields)


@pytest.mark.parametrize(
    "changes",
    [
        dict(slot_mapping=np.asarray([0, 1, 10_000], np.int32)),
        dict(cu_q_lens=np.asarray([0, 2], np.int32)),
        dict(block_tables=np.asarray([[999]], np.int32)),
        dict(logits_indices=np.asarray([3], np.int32)),
        dict(sample_rows=np.asarray([8], np.int32)),
        dict(copy_src=np.asarray([1], np.int32), copy_dst=np.asarray([48], np.int32)),
        dict(
            token_ids=np.arange(17, dtype=np.int32),
            positions=np.arange(17, dtype=np.int32),
            slot_mapping=np.arange(17, dtype=np.int32),
            cu_q_lens=np.asarray([0, 17], np.int32),
            kv_lens=np.asarray([17], np.int32),
            block_tables=np.asarray([[0, 1, 2, 3, 4]], np.int32),
        ),
    ],
)
def test_invalid_plans_are_rejected(runner: ModelRunner, changes: dict[str, Any]) -> None:
    runner.set_request(0, DeviceSamplingParams(temperature=0.0))
    assert runner.execute(_simple_plan()).sampled_token_ids.shape == (1,)
    with pytest.raises(ValueError):
        runner.execute(_simple_plan(**changes))


def test_set_request_validation(runner: ModelRunner) -> None:
    with pytest.raises(ValueError, match="seat"):
        runner.set_request(8, DeviceSamplingParams())
    with pytest.raises(ValueError, match="logprobs"):
        runner.set_request(0, DeviceSamplingParams(logprobs=4))
    with pytest.raises(ValueError, match="max_model_len"):
        runner.set_request(0, DeviceSamplingParams(), list(range(65)))
    with pytest.raises(ValueError):
        DeviceSamplingParams(top_p=0.0)


def test_runner_rejects_unsupported_lengths(config: ModelConfig, params: Any) -> None:
    with pytest.raises(ValueError, match="max_position_embeddings"):
        make_runner(config, params, max_model_len=4096)
    # A sliding window no longer caps the length: max_model_len may exceed it.
    windowed = config.with_overrides(sliding_window=32, layer_types=("sliding_attention",)
                                     * config.num_layers)
    ModelRunner(windowed, params, num_blocks=16, block_size=4, max_model_len=64)
