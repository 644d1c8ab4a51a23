"""A token's logits do not depend on how many rows its step has: a speculative
verification (a sequence's next token and its drafts in one step) gives every kept
token the bits the decode step without speculation gives it, greedy tokens and
logprobs alike, and ``batch_invariant`` generation equals ``LLM.score`` bit for bit.

The model has eight layers (two calls of the layered step), 32-wide heads and a Q5_1
gate projection. Before 2026-11-28 the first check failed on Q5_1 (a row alone took the
one-row integer kernel, among others the float panel; Q5_1 now has the lanes kernel) and
the second on RoPE: XLA:CPU fused its multiply-adds differently in a one-row decode step
and in a prompt step (``apply_rope(exact=True)`` now rounds once, in float64). RMSNorm's
reduction order (``tree_row_sums``) is checked in ``tests/model/test_row_reductions.py``.
"""

from __future__ import annotations

from pathlib import Path

import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import numpy as np
import pytest
from gguf_fixtures import TOKENIZER_VOCAB, write_gguf
from kvpage import LLM, SamplingParams
from model_fixtures import build_hf_model

LOOP = [5, 17, 99, 3, 42, 7] * 4
PROMPTS = [{"prompt_token_ids": LOOP}, {"prompt_token_ids": list(range(20, 41)) * 2}]
QUANT = {"token_embd.weight": "Q8_0", "attn_q.weight": "Q4_0", "attn_k.weight": "Q4_1",
         "attn_v.weight": "Q8_0", "attn_output.weight": "Q5_0", "ffn_gate.weight": "Q5_1",
         "ffn_up.weight": "Q4_1", "ffn_down.weight": "Q4_0"}


@pytest.fixture(scope="module")
def deep_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = build_hf_model("qwen2", seed=3, vocab_size=TOKENIZER_VOCAB, hidden_size=128,
                           intermediate_size=128, num_attention_heads=4,
                           num_key_value_heads=2, num_hidden_layers=8,
                           max_position_embeddings=4096, tie_word_embeddings=False)
    return write_gguf(tmp_path_factory.mktemp("deep") / "deep.gguf", model, "qwen2",
                      quant=QUANT)


def _tokens_and_logprobs(llm: LLM, params: SamplingParams) -> list[tuple[list[int], list]]:
    out = []
    for request in llm.generate(PROMPTS, params, use_tqdm=False):
        c = request.outputs[0]
        out.append((list(c.token_ids), [next(iter(s.values())).logprob for s in c.logprobs]))
    return out


def test_speculation_keeps_every_bit_of_greedy_outputs(deep_model: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=0)
    args = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=128, block_size=8)
    plain = _tokens_and_logprobs(LLM(str(deep_model), **args), params)
    # Drafted by the model itself: every greedy draft is right, so verifications of
    # eight rows keep all of them.
    spec = {"method": "draft_model", "model": str(deep_model), "num_speculative_tokens": 7,
            "max_running": 4}
    llm = LLM(str(deep_model), speculative_config=spec, **args)
    got = _tokens_and_logprobs(llm, params)
    assert [tokens for tokens, _ in got] == [tokens for tokens, _ in plain]
    assert got == plain  # logprobs bit for bit too
    stats = llm.engine._ctx.scheduler.stats()
    assert stats["spec_decode_num_accepted_tokens"] > 10  # verifications did run
    assert stats["num_referenced_blocks"] == 0


def test_batch_invariant_generation_equals_score(deep_model: Path) -> None:
    llm = LLM(str(deep_model), max_num_seqs=8, max_num_batched_tokens=64,
              max_model_len=128, block_size=8, batch_invariant=True)
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True,
                            logprobs=0)
    probe = {"prompt_token_ids": [5, 17, 99, 3, 42, 7, 250, 11, 64, 12, 80, 91, 33]}
    c = llm.generate([probe], params, use_tqdm=False)[0].outputs[0]
    tokens = list(c.token_ids)
    logprobs = [next(iter(s.values())).logprob for s in c.logprobs]
    scores = llm.score([probe["prompt_token_ids"]], [tokens])[0]
    np.testing.assert_array_equal(scores.astype(np.float32),
                                  np.asarray(logprobs, np.float32))
