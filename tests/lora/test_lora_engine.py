"""LoRA in the engine (:mod:`kvpage.lora`): a request under an adapter generates what
the base model with the adapter merged into its weights generates, rows of different
adapters (and none) share steps without changing each other's outputs, and bad adapters
or requests are refused with the reason."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest
from kvpage import LLM, LoRARequest, SamplingParams
from kvpage.lora.random_adapter import merged_tensors, write_random_adapter
from kvpage.lora.slots import LoRASlotsFullError

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
PROMPTS = [{"prompt_token_ids": [5, 17, 99, 3, 42, 7, 250, 11, 64]},
           {"prompt_token_ids": list(range(20, 45))},
           {"prompt_token_ids": [300, 301, 302]}]
ARGS: dict = dict(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=128, block_size=8)


@pytest.fixture(scope="module")
def lora_llm(tiny_model_dir: Path) -> LLM:
    return LLM(str(tiny_model_dir), enable_lora=True, max_loras=2, max_lora_rank=8, **ARGS)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, lora_llm: LLM, tmp_path_factory: pytest.TempPathFactory
             ) -> list[Path]:
    shapes = lora_llm.engine.runner.lora.shapes(lora_llm.engine.runner.params)
    root = tmp_path_factory.mktemp("adapters")
    return [
        write_random_adapter(root / "all", shapes, rank=8, seed=1),
        write_random_adapter(root / "attn", shapes, rank=4, seed=2,
                             modules=("q_proj", "v_proj", "o_proj")),
    ]


def _tokens(outputs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _logprobs(outputs: list) -> np.ndarray:
    return np.array([[next(iter(d.values())).logprob for d in o.outputs[0].logprobs]
                     for o in outputs])


def test_an_adapter_generates_what_its_merged_weights_generate(
    tiny_model_dir: Path, lora_llm: LLM, adapters: list[Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from safetensors.numpy import load_file, save_file

    merged_dir = tmp_path_factory.mktemp("merged")
    for f in tiny_model_dir.iterdir():
        if f.is_file():
            shutil.copy(f, merged_dir / f.name)
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    save_file(merged_tensors(base, adapters[0]), str(merged_dir / "model.safetensors"))
    merged = LLM(str(merged_dir), **ARGS).generate(PROMPTS, GREEDY, use_tqdm=False)

    request = LoRARequest("all", 1, str(adapters[0]))
    ours = lora_llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=request)
    base_out = lora_llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert _tokens(ours) == _tokens(merged)
    assert _tokens(ours) != _tokens(base_out), "the adapter changes the outputs"
    np.testing.assert_allclose(_logprobs(ours), _logprobs(merged), atol=1e-4)


def test_adapters_mixed_in_one_step_match_each_alone(lora_llm: LLM, adapters: list[Path]
                                                    ) -> None:
    loras = [LoRARequest("all", 1, str(adapters[0])), LoRARequest("attn", 2, str(adapters[1])),
             None]
    alone = [lora_llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=r)
             for r in loras]
    # every prompt under every adapter, all in the same steps
    prompts = [p for p in PROMPTS for _ in loras]
    mixed = lora_llm.generate(prompts, GREEDY, use_tqdm=False,
                              lora_request=[r for _ in PROMPTS for r in loras])
    for i in range(len(PROMPTS)):
        for j in range(len(loras)):
            assert mixed[i * len(loras) + j].outputs[0].token_ids == \
                alone[j][i].outputs[0].token_ids
    engine = lora_llm.engine
    engine.check_invariants()
    assert engine.get_stats()["kv_cache_usage_perc"] == 0.0
    assert engine.lora is not None and sum(engine.lora.pins) == 0, "every slot unpinned"


def test_bad_adapters_and_requests_are_refused_with_the_reason(
    tiny_model_dir: Path, lora_llm: LLM, adapters: list[Path], tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match="enable_lora"):
        LLM(str(tiny_model_dir), **ARGS).generate(
            PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=LoRARequest("a", 1, "x"))
    with pytest.raises(ValueError, match="adapter_config.json"):
        lora_llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False,
                          lora_request=LoRARequest("missing", 7, str(tmp_path)))
    shapes = lora_llm.engine.runner.lora.shapes(lora_llm.engine.runner.params)
    big = write_random_adapter(tmp_path / "big", shapes, rank=16)
    with pytest.raises(ValueError, match="max_lora_rank=8"):
        lora_llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False,
                          lora_request=LoRARequest("big", 8, str(big)))
    with pytest.raises(ValueError, match="positive integer"):
        LoRARequest("zero", 0, str(big))
    # three adapters live at once with max_loras=2: the third is refused, the rest run
    third = write_random_adapter(tmp_path / "third", shapes, rank=2, seed=3)
    loras = [LoRARequest("all", 1, str(adapters[0])), LoRARequest("attn", 2, str(adapters[1])),
             LoRARequest("third", 3, str(third))]
    with pytest.raises(LoRASlotsFullError, match="max_loras=2"):
        lora_llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=loras)
    assert not lora_llm.engine.has_unfinished_requests()
    assert sum(lora_llm.engine.lora.pins) == 0
    ok = lora_llm.generate(PROMPTS[:1], GREEDY, use_tqdm=False, lora_request=loras[2])
    assert len(ok[0].outputs[0].token_ids) == 8


def test_rollouts_and_scores_run_under_the_adapter(lora_llm: LLM, adapters: list[Path]
                                                  ) -> None:
    request = LoRARequest("all", 1, str(adapters[0]))
    sampled = lora_llm.generate(PROMPTS, GREEDY, use_tqdm=False, lora_request=request)
    batch = lora_llm.rollout(PROMPTS, GREEDY, lora_request=request)
    assert [list(t[:n]) for t, n in zip(batch.token_ids, batch.lengths, strict=True)] == \
        _tokens(sampled)
    scores = lora_llm.score([p["prompt_token_ids"] for p in PROMPTS], _tokens(sampled),
                            lora_request=request)
    np.testing.assert_allclose(np.stack(scores), _logprobs(sampled), atol=1e-4)
    base = lora_llm.score([p["prompt_token_ids"] for p in PROMPTS], _tokens(sampled))
    assert not np.allclose(np.stack(base), _logprobs(sampled), atol=1e-3)
