"""Asynchronous rollouts (:class:`kvpage.rl.AsyncRollouts`): samples come back as they
finish, pushes land at step boundaries with per-token versions, stale samples are
aborted or resumed as asked, LoRA policies keep several versions resident, and every
sample is collected exactly once with every KV block back in the pool."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from kvpage import LLM, SamplingParams
from kvpage.lora.adapter import load_peft_adapter
from kvpage.lora.random_adapter import write_random_adapter
from kvpage.rl import AsyncRollouts

ARGS: dict = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=256, block_size=8)
PROMPTS = [{"prompt_token_ids": [5, 17, 99, 3]}, {"prompt_token_ids": list(range(20, 30))},
           {"prompt_token_ids": [300, 301, 302]}]


def params(max_tokens: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, seed=i)
            for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), enable_lora=True, max_loras=2, max_lora_rank=8, **ARGS)


def perturbed(llm: LLM, scale: float) -> object:
    base = llm.engine.runner.base_params()
    return jax.tree.map(lambda x: x * scale if getattr(x, "ndim", 0) > 1 else x, base)


def versions(sample: object) -> list[int]:
    return [v for _, v in sample.params_versions]  # type: ignore[attr-defined]


def test_samples_resume_under_pushed_weights_and_carry_their_versions(llm: LLM) -> None:
    rollouts = AsyncRollouts(llm, max_staleness=0, on_stale="resume")
    version = llm.engine.params_version
    first = rollouts.submit(PROMPTS, params(40))
    rollouts.push_params(perturbed(llm, 1.01))
    second = rollouts.submit(PROMPTS, params(8))
    samples = rollouts.collect(count=6, timeout=120)
    assert sorted(s.request_id for s in samples) == sorted(first + second)
    for s in samples:
        assert len(s.token_ids) == len(s.logprobs) == (40 if s.request_id in first else 8)
        assert not s.stale and s.finish_reason == "length"
        assert versions(s) == sorted(versions(s))
        assert set(versions(s)) <= {version, version + 1}
        if s.request_id in second:
            assert s.started_version == version + 1 and versions(s) == [version + 1]
    assert [s.index for s in sorted(samples, key=lambda s: s.index)] == list(range(6))
    assert rollouts.collect() == [] and rollouts.num_live == 0
    rollouts.close()
    llm.engine.check_invariants()
    assert llm.engine.get_stats()["kv_cache_usage_perc"] == 0.0


def test_stale_samples_are_aborted_and_handed_back(llm: LLM) -> None:
    rollouts = AsyncRollouts(llm, max_staleness=0, on_stale="abort")
    old = rollouts.submit(PROMPTS, params(200))
    rollouts.push_params(perturbed(llm, 0.99))  # applied before the thread's next step
    fresh = rollouts.submit(PROMPTS[:1], params(4)[:1])
    samples = {s.request_id: s for s in rollouts.collect(count=4, timeout=120)}
    for rid in old:
        assert samples[rid].stale and samples[rid].finish_reason == "abort"
    assert not samples[fresh[0]].stale and len(samples[fresh[0]].token_ids) == 4
    rollouts.close()
    assert llm.engine.get_stats()["kv_cache_usage_perc"] == 0.0


def test_lora_policies_keep_older_versions_resident(llm: LLM, tmp_path: Path) -> None:
    runner = llm.engine.runner
    shapes = runner.lora.shapes(runner.params)
    adapters = [load_peft_adapter(write_random_adapter(tmp_path / f"v{i}", shapes, seed=i),
                                  shapes, 8) for i in range(3)]
    too_stale = AsyncRollouts(llm, max_staleness=2)
    with pytest.raises(ValueError, match="max_loras >= 3"):
        too_stale.push_lora(adapters[0])
    too_stale.close()
    rollouts = AsyncRollouts(llm, max_staleness=1, on_stale="abort")
    rollouts.push_lora(adapters[0])
    a = rollouts.submit(PROMPTS, params(30))
    rollouts.push_lora(adapters[1])  # a's samples are one version old: they go on
    b = rollouts.submit(PROMPTS, params(6))
    samples = {s.request_id: s for s in rollouts.collect(count=6, timeout=120)}
    assert all(not s.stale and len(s.token_ids) == 30 for r, s in samples.items() if r in a)
    assert all(len(samples[r].token_ids) == 6 for r in b)
    rollouts.push_lora(adapters[2])  # nothing live: the oldest slot is reused
    c = rollouts.submit(PROMPTS[:1], params(5)[:1])
    assert len(rollouts.collect(count=1, timeout=120)[0].token_ids) == 5 and c
    rollouts.close()
    assert sum(llm.engine.lora.pins) == 0
    np.testing.assert_equal(llm.engine.get_stats()["kv_cache_usage_perc"], 0.0)
