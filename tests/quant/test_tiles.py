"""Q4_0 experts packed into tiles of sixteen rows for the CPU kernel
(``kvpage.quant.tiles``): the layout Rust's ``pack_q4_0_tiles`` describes, undone
exactly in the step, and an engine whose experts are packed generating the same tokens
and logprobs, bit for bit, as one that keeps GGUF's row order."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import numpy as np
import pytest
from kvpage.quant.tiles import can_pack, pack_q4_0_tiles, unpack_q4_0_tiles
from kvpage.quant.weights import QuantizedWeight

SMALL = dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, experts=8, top_k=2,
             expert_width=32, vocab=512, context=256)


def random_q4_0(shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    *lead, outs, inner = shape
    blocks = np.random.default_rng(seed).integers(0, 256, (*lead, outs, inner // 32, 18),
                                                  dtype=np.uint8)
    scales = np.random.default_rng(seed + 1).uniform(0.001, 0.01, (*lead, outs, inner // 32))
    blocks[..., :2] = scales.astype(np.float16).view(np.uint8).reshape(*scales.shape, 2)
    return blocks.reshape(*lead, outs, inner // 32 * 18)


def test_packing_is_the_kernel_layout_and_unpacks_exactly() -> None:
    rows = random_q4_0((3, 48, 128))
    packed = pack_q4_0_tiles(rows)
    assert packed.shape == rows.shape and packed.dtype == np.uint8
    np.testing.assert_array_equal(np.asarray(unpack_q4_0_tiles(jnp.asarray(packed))), rows)
    # Per tile and block: sixteen f16 scales, then register q, row o: bytes 4q..4q+4.
    nb = rows.shape[-1] // 18
    for e, tile, b, o, q in [(0, 0, 0, 0, 0), (2, 1, 3, 15, 3), (1, 2, 2, 7, 1)]:
        src = rows[e, 16 * tile + o, 18 * b:18 * (b + 1)]
        at = (tile * nb + b) * 288
        dst = packed[e].reshape(-1)
        np.testing.assert_array_equal(dst[at + 2 * o:at + 2 * o + 2], src[:2])
        nib = at + 32 + 64 * q + 4 * o
        np.testing.assert_array_equal(dst[nib:nib + 4], src[2 + 4 * q:6 + 4 * q])


def test_a_packed_weight_dequantizes_as_its_rows() -> None:
    rows = random_q4_0((2, 32, 64), seed=3)
    plain = QuantizedWeight(jnp.asarray(rows), "q4_0", (2, 32, 64))
    packed = QuantizedWeight(jnp.asarray(pack_q4_0_tiles(rows)), "q4_0", (2, 32, 64),
                             layout="tiles16")
    np.testing.assert_array_equal(np.asarray(packed.dequantize()), np.asarray(plain.dequantize()))
    assert "tiles16" in repr(packed)
    with pytest.raises(ValueError, match="cannot be in layout"):
        QuantizedWeight(jnp.asarray(rows), "q4_1", (2, 32, 64), layout="tiles16")
    with pytest.raises(ValueError, match="row order"):
        packed.take_rows(jnp.asarray([0]))


def _generate(path: Path, monkeypatch: pytest.MonkeyPatch, pack: bool) -> tuple[list, list, str]:
    from kvpage import LLM, SamplingParams

    monkeypatch.setenv("KVPAGE_PACK_EXPERTS", "1" if pack else "0")
    llm = LLM(str(path), max_model_len=64, max_num_seqs=8, num_gpu_blocks=64, block_size=8)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(0, 257, 6 + i).tolist()} for i in range(5)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    out = llm.generate(prompts, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in out]
    logprobs = [[next(iter(d.values())).logprob for d in o.outputs[0].logprobs] for o in out]
    layout = llm.engine.runner.params["layers"][0]["mlp"]["experts"]["gate_proj"]["weight"].layout
    return tokens, logprobs, layout


def test_an_engine_with_packed_experts_generates_the_same_bits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvpage.bench.moe_model import MoEShape, write_random_moe_gguf

    if not can_pack("q4_0", 32):
        pytest.skip("this CPU has no kernel for packed tiles (AVX-512 VNNI)")
    path = write_random_moe_gguf(tmp_path / "moe.gguf", MoEShape(**SMALL))
    tokens, logprobs, layout = _generate(path, monkeypatch, pack=True)
    assert layout == "tiles16"
    rows_tokens, rows_logprobs, rows_layout = _generate(path, monkeypatch, pack=False)
    assert rows_layout == "rows"
    assert tokens == rows_tokens
    assert logprobs == rows_logprobs
