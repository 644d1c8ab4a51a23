"""``kvpage bench moe``'s pieces: the random MoE GGUF it serves loads in kvpage as the
Qwen3-MoE it claims (experts kept in their blocks) and decodes; the expert-traffic
figures follow from the shape."""

from __future__ import annotations

from pathlib import Path

import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import numpy as np
import pytest
from kvpage.bench.moe import expert_traffic
from kvpage.bench.moe_model import MoEShape, write_random_moe_gguf

SMALL = MoEShape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, experts=8, top_k=2,
                 expert_width=32, vocab=512, context=256)


def test_random_moe_file_loads_as_quantized_qwen3_moe_and_generates(tmp_path: Path) -> None:
    from kvpage import LLM, SamplingParams, _core
    from kvpage.model.gguf_loader import load_gguf
    from kvpage.quant.weights import QuantizedWeight

    path = write_random_moe_gguf(tmp_path / "moe.gguf", SMALL)
    config, params, tokenizer = load_gguf(path)
    assert config.architecture == "Qwen3MoeForCausalLM" and tokenizer is not None
    assert (config.moe.num_experts, config.moe.top_k) == (8, 2)
    experts = params["layers"][0]["mlp"]["experts"]["down_proj"]["weight"]
    assert isinstance(experts, QuantizedWeight) and experts.shape == (8, 64, 32)
    # Zero-mean weights: a shared component in every weight once made every sequence
    # emit the same token, so every request of a batch routed to the same experts.
    for name in ("gate_proj", "down_proj"):
        w = np.asarray(params["layers"][0]["mlp"]["experts"][name]["weight"].dequantize())
        assert abs(float(w.mean())) < 0.02 * float(w.std()), name
    # As bench moe's second server runs it: 8-bit inputs (``--cpu-input-bits 8``).
    llm = LLM(str(path), max_model_len=64, max_num_seqs=8, num_gpu_blocks=64, block_size=8,
              cpu_input_bits=8)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(0, 257, 6).tolist()} for _ in range(8)]
    try:
        assert _core.cpu_input_bits() == 8
        out = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0,
                                                   ignore_eos=True), use_tqdm=False)
    finally:
        _core.set_cpu_input_bits(16)
    assert all(len(o.outputs[0].token_ids) == 6 for o in out)
    last = {o.outputs[0].token_ids[-1] for o in out}
    assert len(last) >= 4, f"greedy continuations collapsed to {sorted(last)}"


def test_expert_traffic_is_the_active_experts_at_batch_one() -> None:
    shape = MoEShape()
    one = expert_traffic(shape, 1)
    assert one["streamed_over_active"] == pytest.approx(1.0)
    assert one["active_mb"] == pytest.approx(shape.layers * shape.top_k * shape.expert_bytes()
                                             / 1e6)
    many = expert_traffic(shape, 32)  # experts shared by the step's tokens
    assert many["streamed_mb"] < one["streamed_mb"] < one["dense_mb"]


def test_the_table_gives_each_input_precision_its_ratio(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    from kvpage.bench.moe import DENSE, ROUTED, ROUTED_8_BIT, print_table

    def server(name: str, tok_s: float) -> dict:
        return {"server": name, "levels": {32: {"output_tok_s": tok_s}}}

    shape = MoEShape()
    result = {"model": {"shape": shape.__dict__, "file_mb": 244.0}, "concurrency": [32],
              "servers": [server(ROUTED, 300.0), server(ROUTED_8_BIT, 450.0),
                          server("llama.cpp", 250.0)],
              "traffic": {32: expert_traffic(shape, 32)}}
    print_table(result)
    row = capsys.readouterr().out.splitlines()[-1].split()
    assert row[:8] == ["32", "300.0", "450.0", "-", "250.0", "1.20x", "1.80x", "-"]
    result["servers"] = [server(ROUTED, 300.0), server(DENSE, 60.0)]  # --input-bits 16
    print_table(result)
    row = capsys.readouterr().out.splitlines()[-1].split()
    assert row[:8] == ["32", "300.0", "-", "60.0", "-", "-", "-", "5.00x"]
