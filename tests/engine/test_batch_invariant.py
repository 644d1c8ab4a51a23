"""``batch_invariant=True``: a sample's tokens and logprobs are bitwise identical alone
and inside batches of 2 and 64 mixed requests (chunked prefill, preemption, multi-step decode),
and bitwise equal to ``LLM.score`` of the same tokens."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from kvpage import LLM, SamplingParams

PROBE = {"prompt_token_ids": [5, 17, 99, 3, 42, 7, 250, 11, 64, 12, 80, 91, 33]}
PARAMS = SamplingParams(temperature=1.0, max_tokens=24, ignore_eos=True, seed=7, logprobs=0)


def make(model: Path, **overrides: object) -> LLM:
    args: dict = dict(max_num_seqs=64, max_num_batched_tokens=48, max_model_len=128,
                      block_size=8, batch_invariant=True)
    args.update(overrides)
    return LLM(str(model), **args)


def _probe(outputs: list) -> tuple[list[int], np.ndarray]:
    c = outputs[0].outputs[0]
    return c.token_ids, np.array([next(iter(d.values())).logprob for d in c.logprobs],
                                 np.float32)


def _others(count: int, seed: int, vocab: int = 400) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [{"prompt_token_ids": rng.integers(4, vocab, rng.integers(1, 40)).tolist()}
            for _ in range(count)]


@pytest.fixture(scope="module")
def llm(tiny_model_dir: Path) -> LLM:
    return make(tiny_model_dir)


def test_a_sample_is_bitwise_the_same_alone_and_in_any_batch(llm: LLM) -> None:
    alone_tokens, alone_logprobs = _probe(llm.generate([PROBE], PARAMS, use_tqdm=False))
    for count in (1, 63):
        others = _others(count, count)
        params = [PARAMS] + [SamplingParams(temperature=1.0, max_tokens=int(n), seed=i,
                                            ignore_eos=True)
                             for i, n in enumerate(np.random.default_rng(count).integers(
                                 1, 40, count))]
        # the probe in the middle of the queue, behind prompts it shares steps with
        batch = others[: count // 2] + [PROBE] + others[count // 2:]
        params = params[1: count // 2 + 1] + [PARAMS] + params[count // 2 + 1:]
        out = llm.generate(batch, params, use_tqdm=False)
        tokens, logprobs = _probe(out[count // 2: count // 2 + 1])
        assert tokens == alone_tokens, count
        assert np.array_equal(logprobs, alone_logprobs), count
    scores = llm.score([PROBE["prompt_token_ids"]], [alone_tokens])[0]
    assert np.array_equal(scores.astype(np.float32), alone_logprobs)


def test_preemption_keeps_the_sample_bitwise(tiny_model_dir: Path, llm: LLM) -> None:
    expected = _probe(llm.generate([PROBE], PARAMS, use_tqdm=False))
    small = make(tiny_model_dir, num_gpu_blocks=12, max_num_seqs=8, max_model_len=64)
    out = small.generate(_others(3, 5) + [PROBE], [PARAMS] * 4, use_tqdm=False)
    assert small.engine.get_stats()["num_preemptions"] > 0
    tokens, logprobs = _probe(out[3:])
    assert tokens == expected[0] and np.array_equal(logprobs, expected[1])


def test_gguf_quantized_weights_are_bitwise_invariant_too(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    import model_fixtures  # noqa: F401  (sys.path / import setup)
    from gguf_fixtures import TOKENIZER_VOCAB, write_gguf
    from model_fixtures import build_hf_model

    model = build_hf_model("llama", seed=3, vocab_size=TOKENIZER_VOCAB, intermediate_size=128,
                           tie_word_embeddings=True, num_hidden_layers=2)
    quant = {"token_embd.weight": "Q8_0", "attn_q.weight": "Q4_0", "attn_k.weight": "Q4_1",
             "attn_v.weight": "Q8_0", "attn_output.weight": "Q5_0", "ffn_gate.weight": "Q5_1",
             "ffn_up.weight": "Q4_1", "ffn_down.weight": "Q4_0"}
    path = write_gguf(tmp_path_factory.mktemp("inv") / "q.gguf", model, "llama", quant=quant)
    llm = make(path, max_num_batched_tokens=64)
    alone_tokens, alone_logprobs = _probe(llm.generate([PROBE], PARAMS, use_tqdm=False))
    others = _others(9, 2, vocab=TOKENIZER_VOCAB)
    out = llm.generate(others[:4] + [PROBE] + others[4:],
                       [SamplingParams(max_tokens=9, ignore_eos=True)] * 4 + [PARAMS]
                       + [SamplingParams(max_tokens=30, ignore_eos=True)] * 5, use_tqdm=False)
    tokens, logprobs = _probe(out[4:5])
    assert tokens == alone_tokens and np.array_equal(logprobs, alone_logprobs)
    scores = llm.score([PROBE["prompt_token_ids"]], [alone_tokens])[0]
    assert np.array_equal(scores.astype(np.float32), alone_logprobs)
