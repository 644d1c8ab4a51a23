"""Quantized weights kept as they are stored (issue #27): GGUF blocks and per-channel
int8 in the params tree, dequantized bit-exactly where a float view is needed, and
multiplied by the Rust kernels on CPU.

Checks: the JAX dequantization against ``gguf``'s reference on every supported format
(a GGUF file written here, and the real SmolLM2 file where present); the CPU kernel
against dequantize-then-matmul for every format and row count; whole models
(a tiny GGUF written here, a tiny HF checkpoint quantized to int8, and SmolLM2 where
present) against kvpage's own float path: greedy agreement and logprob differences;
the modes, the pytree and the errors.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import numpy as np
import pytest
from gguf_fixtures import TOKENIZER_VOCAB, random_blocks, write_gguf
from kvpage.kernels.host import cpu_qmatmul
from kvpage.model.gguf_loader import load_gguf
from kvpage.model.linear_kernels import host_matmuls, live_rows, matmul_nt
from kvpage.quant import QuantizedWeight, formats, is_quantized
from kvpage.quant.gguf_blocks import dequantize_blocks
from kvpage.quant.int8 import quantize_int8
from kvpage.quant.modes import keeps_gguf_blocks
from model_fixtures import build_hf_model, prefill_logits, save_hf_model

# GGUF type name -> kvpage format, from the formats table (tests/quant/test_formats.py).
GGUF_KINDS = formats.GGUF_KEPT
# Types gguf-py quantizes itself; the K-quants are written as random blocks.
QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1")


def stored_blocks(kind: str, shape: tuple[int, int], seed: int = 0) -> np.ndarray:
    """Realistic blocks of ``kind`` for a float weight of ``shape``."""
    import gguf
    from gguf.quants import quantize

    if kind in QUANTIZABLE:
        values = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.05
        return quantize(values, gguf.GGMLQuantizationType[kind])
    return random_blocks(shape, kind, seed)


def reference_values(kind: str, blocks: np.ndarray) -> np.ndarray:
    import gguf
    from gguf.quants import dequantize

    return dequantize(blocks, gguf.GGMLQuantizationType[kind])


@pytest.mark.parametrize("kind", list(GGUF_KINDS))
def test_dequantization_is_bit_exact_with_gguf(kind: str) -> None:
    blocks = stored_blocks(kind, (24, 512), seed=1)
    want = reference_values(kind, blocks)
    got = np.asarray(jax.jit(lambda b: dequantize_blocks(GGUF_KINDS[kind], b, 512))(blocks))
    assert got.dtype == np.float32 and got.shape == want.shape
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_embedding_rows_dequantize_only_the_rows_asked_for() -> None:
    blocks = stored_blocks("Q8_0", (40, 64), seed=2)
    weight = QuantizedWeight(jnp.asarray(blocks), "q8_0", (40, 64))
    ids = jnp.asarray([3, 39, 0, 3], jnp.int32)
    want = reference_values("Q8_0", blocks)[np.asarray(ids)]
    np.testing.assert_array_equal(np.asarray(weight.take_rows(ids)), want)


@pytest.mark.parametrize("kind", formats.KINDS)
@pytest.mark.parametrize("rows", [1, 3, 8, 37, 130])
def test_cpu_kernel_matches_dequantize_then_matmul(kind: str, rows: int) -> None:
    inner, outs = 512, 72
    rng = np.random.default_rng(rows)
    if kind == "int8":
        float_weight = rng.standard_normal((outs, inner)).astype(np.float32) * 0.05
        weight = jax.device_put(quantize_int8(float_weight))
    else:
        name = {v: k for k, v in GGUF_KINDS.items()}[kind]
        weight = QuantizedWeight(jnp.asarray(stored_blocks(name, (outs, inner), rows)), kind,
                                 (outs, inner))
    x = jnp.asarray(rng.standard_normal((rows, inner)).astype(np.float32))
    want = np.asarray(x) @ np.asarray(weight.dequantize()).T
    with host_matmuls(True):
        got = np.asarray(jax.jit(lambda x, w: matmul_nt(x, w))(x, weight))
    with host_matmuls(True):
        hlo = jax.jit(lambda x, w: matmul_nt(x, w)).lower(x, weight).as_text()
    # Prefill-sized products: the core dequantizes, XLA's GEMM multiplies.
    path = "qmatmul" if rows < cpu_qmatmul.dequantize_rows(kind) else "dequantize"
    assert f"kvpage_{path}_{kind}" in hlo
    scale = np.abs(want).max()
    # The integer path (16-bit inputs, ~2e-5 relative: up to integer_rows rows, any row
    # count below the hand-over with AVX-512 VNNI) may be off by more than the float paths.
    integer = path == "qmatmul" and (
        rows <= cpu_qmatmul.integer_rows(kind) or cpu_qmatmul.integer_blocks(kind)
    )
    tolerance = 1e-4 if integer else 1e-5
    assert np.abs(got - want).max() <= tolerance * scale


def eight_bit(x: np.ndarray) -> np.ndarray:
    """``x`` rounded as 8-bit inputs per block of 32: ``d8 = max|x| / 127``,
    ``round(x / d8) · d8`` (llama.cpp's ``q8`` scale; ties go to even here, away from
    zero in llama.cpp)."""
    blocks = x.reshape(*x.shape[:-1], -1, 32).astype(np.float32)
    d8 = np.abs(blocks).max(axis=-1, keepdims=True) / np.float32(127)
    inverse = np.where(d8 == 0, np.float32(0), np.float32(1) / np.where(d8 == 0, 1, d8))
    q = np.clip(np.rint(blocks * inverse.astype(np.float32)), -127, 127)
    return (q * d8).reshape(x.shape)


@pytest.mark.parametrize("rows", [1, 5])
def test_eight_bit_inputs_are_llama_cpps_rounding_until_set_back(rows: int) -> None:
    """``set_cpu_input_bits(8)`` (``EngineConfig.cpu_input_bits``): the integer path's
    products are those of the 8-bit inputs (Q8_0: no offset, the same on every path),
    ~1e-3 away from the 16-bit ones; 16 restores them."""
    from kvpage import _core
    from kvpage.engine.config import EngineConfig

    if rows > cpu_qmatmul.integer_rows("q8_0") and not cpu_qmatmul.integer_blocks("q8_0"):
        pytest.skip("this CPU's integer path takes one row (no AVX2)")
    inner, outs = 512, 48
    rng = np.random.default_rng(rows)
    weight = QuantizedWeight(jnp.asarray(stored_blocks("Q8_0", (outs, inner), rows)), "q8_0",
                             (outs, inner))
    x = rng.standard_normal((rows, inner)).astype(np.float32)
    dequantized = np.asarray(weight.dequantize(), np.float64)

    def product() -> np.ndarray:
        with host_matmuls(True):
            return np.asarray(jax.jit(lambda x, w: matmul_nt(x, w))(jnp.asarray(x), weight))

    assert _core.cpu_input_bits() == 16
    sixteen = product()
    try:
        _core.set_cpu_input_bits(8)
        got = product()
    finally:
        _core.set_cpu_input_bits(16)
    want = eight_bit(x).astype(np.float64) @ dequantized.T
    scale = np.abs(want).max()
    assert np.abs(got - want).max() <= 1e-5 * scale
    assert 1e-5 * scale < np.abs(got - sixteen).max() < 2e-2 * scale
    np.testing.assert_array_equal(product(), sixteen)
    with pytest.raises(ValueError, match="input bits must be 8 or 16, got 4"):
        _core.set_cpu_input_bits(4)
    with pytest.raises(ValueError, match="cpu_input_bits must be one of"):
        EngineConfig(model="m", cpu_input_bits=4)


@pytest.mark.parametrize("kind", ["q4_1", "int8"])
def test_the_cpu_kernel_leaves_padding_rows_out(kind: str) -> None:
    """Rows past the live count are zeros; the live ones are the full product's (a live
    count of 1 takes the one-row path, so it is compared with a one-row call)."""
    inner, outs, rows = 256, 40, 8
    rng = np.random.default_rng(5)
    if kind == "int8":
        weight = quantize_int8(rng.standard_normal((outs, inner)).astype(np.float32) * 0.05)
    else:
        blocks = jnp.asarray(stored_blocks("Q4_1", (outs, inner), 5))
        weight = QuantizedWeight(blocks, kind, (outs, inner))
    x = jnp.asarray(rng.standard_normal((rows, inner)).astype(np.float32))
    run = jax.jit(
        lambda x, live: cpu_qmatmul.qmatmul_call(x, weight.blocks, weight.row_scales, kind, live)
    )
    full = np.asarray(run(x, rows))
    for live in (0, 1, 5):
        got = np.asarray(run(x, live))
        alone = full if live != 1 else np.asarray(run(x[:1], 1))
        np.testing.assert_array_equal(got[:live], alone[:live])
        assert not got[live:].any()
    for bad in (-1, rows + 1):
        with pytest.raises(Exception, match="live_rows"):
            np.asarray(run(x, bad))


@pytest.mark.parametrize("kind", ["q4_0", "q4_1", "q4_k", "q8_0", "int8"])
@pytest.mark.parametrize("rows,live", [(1, 1), (6, 4), (40, 40)])
def test_one_call_of_several_weights_equals_their_calls_one_by_one(
    kind: str, rows: int, live: int
) -> None:
    """``kvpage_qmatmul_multi_<kind>`` (a layer's q/k/v in one call): each result is the
    separate call's, bit for bit, padding rows zeros; ``linears`` traces one call."""
    from kvpage.model.linear import linears

    assert cpu_qmatmul.multi_available(kind)
    inner, outs = 256, (48, 16, 16)
    rng = np.random.default_rng(9)
    if kind == "int8":
        weights = [
            quantize_int8(rng.standard_normal((n, inner)).astype(np.float32) * 0.05) for n in outs
        ]
    else:
        gguf_kind = {v: k for k, v in GGUF_KINDS.items()}[kind]
        weights = [
            QuantizedWeight(jnp.asarray(stored_blocks(gguf_kind, (n, inner), i)), kind, (n, inner))
            for i, n in enumerate(outs)
        ]
    x = jnp.asarray(rng.standard_normal((rows, inner)).astype(np.float32))
    pairs = [(w.blocks, w.row_scales) for w in weights]
    fused = jax.jit(lambda x: cpu_qmatmul.qmatmul_multi_call(x, pairs, kind, live))(x)
    for (blocks, scales), got in zip(pairs, fused, strict=True):
        alone = jax.jit(lambda x, b=blocks, s=scales: cpu_qmatmul.qmatmul_call(x, b, s, kind, live))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(alone(x)))
        assert not np.asarray(got)[live:].any()

    layers = [{"weight": w} for w in weights]
    with host_matmuls(True):
        text = jax.jit(lambda x: linears(x, layers)).lower(x).as_text()
    assert text.count(f"kvpage_qmatmul_multi_{kind}") == 1
    assert f"kvpage_qmatmul_{kind}" not in text


def test_one_call_of_several_weights_refuses_bad_operands() -> None:
    assert cpu_qmatmul.multi_available("q4_0")
    weight = QuantizedWeight(jnp.asarray(stored_blocks("Q4_0", (16, 64), 1)), "q4_0", (16, 64))
    x = jnp.ones((2, 64), jnp.float32)
    with pytest.raises(ValueError, match="1 to 4 weights"):
        cpu_qmatmul.qmatmul_multi_call(x, [(weight.blocks, None)] * 5, "q4_0")
    other = jnp.asarray(stored_blocks("Q4_0", (16, 96), 2))  # rows of another inner size
    with pytest.raises(Exception, match="inconsistent shapes"):
        np.asarray(
            jax.jit(
                lambda x: cpu_qmatmul.qmatmul_multi_call(
                    x, [(weight.blocks, None), (other, None)], "q4_0"
                )
            )(x)[0]
        )


def test_a_traced_step_tells_the_kernel_its_live_rows() -> None:
    """Inside ``live_rows``, products of that many rows carry the live count; products of
    another row count (the sampled rows' lm_head) do not."""
    weight = QuantizedWeight(jnp.asarray(stored_blocks("Q4_1", (16, 64), 3)), "q4_1", (16, 64))

    def step(x: jax.Array, live: jax.Array) -> tuple[jax.Array, jax.Array]:
        with live_rows(x.shape[0], live):
            return matmul_nt(x, weight), matmul_nt(x[:2], weight)

    x = jnp.asarray(np.random.default_rng(6).standard_normal((4, 64)).astype(np.float32))
    with host_matmuls(True):
        padded, first_two = jax.jit(step)(x, jnp.int32(3))
    assert not np.asarray(padded)[3:].any()
    np.testing.assert_array_equal(np.asarray(padded)[:2], np.asarray(first_two))


def test_without_the_switch_a_quantized_weight_is_dequantized_in_the_step() -> None:
    blocks = stored_blocks("Q4_1", (16, 64), seed=3)
    weight = QuantizedWeight(jnp.asarray(blocks), "q4_1", (16, 64))
    x = jnp.ones((2, 64), jnp.float32)
    hlo = jax.jit(lambda x, w: matmul_nt(x, w)).lower(x, weight).as_text()
    assert "kvpage_qmatmul" not in hlo
    got = np.asarray(jax.jit(lambda x, w: matmul_nt(x, w))(x, weight))
    np.testing.assert_allclose(got, np.ones((2, 64)) @ reference_values("Q4_1", blocks).T,
                               rtol=1e-5)


def test_the_pytree_keeps_format_and_shape_static() -> None:
    blocks = jnp.asarray(stored_blocks("Q4_0", (8, 64)))
    weight = QuantizedWeight(blocks, "q4_0", (8, 64))
    leaves, tree = jax.tree_util.tree_flatten({"w": weight})
    assert len(leaves) == 1 and leaves[0] is blocks
    rebuilt = jax.tree_util.tree_unflatten(tree, leaves)["w"]
    assert (rebuilt.kind, rebuilt.shape, rebuilt.dtype) == ("q4_0", (8, 64), jnp.float32)
    assert weight.nbytes == 8 * 64 // 32 * 18 and is_quantized(rebuilt)
    with pytest.raises(ValueError, match=r"q4_0 blocks of a \(8, 64\) weight must be \(8, 36\)"):
        QuantizedWeight(blocks[:, :30], "q4_0", (8, 64))
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantizedWeight(blocks, "q4_0", (8, 48))
    with pytest.raises(ValueError, match="unknown quantized format 'q3'"):
        QuantizedWeight(blocks, "q3", (8, 64))


def test_auto_keeps_blocks_only_on_one_cpu_device() -> None:
    assert keeps_gguf_blocks("auto", "cpu")
    assert not keeps_gguf_blocks("auto", "gpu")
    assert not keeps_gguf_blocks("auto", "cpu", tensor_parallel_size=2)
    assert keeps_gguf_blocks("gguf", "gpu") and not keeps_gguf_blocks("none", "cpu")
    with pytest.raises(ValueError, match="quantization must be one of auto, none, gguf, int8"):
        keeps_gguf_blocks("fp4", "cpu")


# ---- whole models -------------------------------------------------------------------

QUANT = {
    "token_embd.weight": "Q8_0",
    "attn_q.weight": "Q8_0",
    "attn_k.weight": "Q4_1",
    "attn_v.weight": "Q4_0",
    "attn_output.weight": "Q5_0",
    "ffn_gate.weight": "Q4_1",
    "ffn_up.weight": "F16",  # not kept: dequantized at load
    # Layers of different formats, as a K-quant mixture file (Q4_K_M) has them: ffn_down
    # is Q4_K, Q6_K, then float; with five layers the step runs groups (0, 1, 2) and
    # (3, 4), whose layers differ in structure (two compiled pieces, not one per length).
    "blk.0.ffn_down.weight": "Q4_K",
    "blk.1.ffn_down.weight": "Q6_K",
}
PROMPTS = [[1, 5, 9, 200, 3, 7, 7, 7, 11, 13, 250, 17], [40, 41, 42], [99] * 20]


@pytest.fixture(scope="module")
def quantized_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = build_hf_model("llama", seed=21, vocab_size=TOKENIZER_VOCAB, intermediate_size=256,
                           tie_word_embeddings=True, num_hidden_layers=5)
    return write_gguf(tmp_path_factory.mktemp("q") / "quantized.gguf", model, "llama",
                      quant=QUANT)


def test_gguf_blocks_stay_stored_and_match_the_dequantized_model(quantized_gguf: Path) -> None:
    config, kept, _ = load_gguf(quantized_gguf, tokenizer=False)
    _, dense, _ = load_gguf(quantized_gguf, tokenizer=False, quantization="none")
    layer = kept["layers"][1]
    kinds = {
        "q": layer["self_attn"]["q_proj"]["weight"].kind,
        "k": layer["self_attn"]["k_proj"]["weight"].kind,
        "v": layer["self_attn"]["v_proj"]["weight"].kind,
        "down": layer["mlp"]["down_proj"]["weight"].kind,
        "embed": kept["embed_tokens"]["weight"].kind,
    }
    assert kinds == {"q": "q8_0", "k": "q4_1", "v": "q4_0", "down": "q6_k", "embed": "q8_0"}
    assert layer["self_attn"]["o_proj"]["weight"].kind == "q5_0"
    assert not is_quantized(layer["mlp"]["up_proj"]["weight"])  # F16: dequantized
    # Every kept tensor (q/k rows un-permuted as whole block rows) equals the float load.
    flat_kept = jax.tree_util.tree_leaves(kept, is_leaf=is_quantized)
    flat_dense = jax.tree_util.tree_leaves(dense)
    for stored, values in zip(flat_kept, flat_dense, strict=True):
        view = stored.dequantize() if is_quantized(stored) else stored
        np.testing.assert_array_equal(np.asarray(view), np.asarray(values))
    np.testing.assert_array_equal(prefill_logits(config, kept, PROMPTS[0]),
                                  prefill_logits(config, dense, PROMPTS[0]))


def greedy(llm: Any, prompts: list[list[int]], tokens: int) -> list[Any]:
    from kvpage import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, logprobs=0)
    return [o.outputs[0] for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]


def agreement(a: list[Any], b: list[Any]) -> tuple[float, float]:
    """Share of positions where greedy tokens agree (up to each sample's first
    difference, counting the rest as disagreeing) and the mean |logprob difference|
    of the agreeing prefix."""
    same = total = 0
    diffs = []
    for x, y in zip(a, b, strict=True):
        total += len(x.token_ids)
        for i, (s, t) in enumerate(zip(x.token_ids, y.token_ids, strict=True)):
            if s != t:
                break
            same += 1
            diffs.append(abs(x.logprobs[i][s].logprob - y.logprobs[i][t].logprob))
    return same / total, float(np.mean(diffs))


def test_a_quantized_gguf_engine_agrees_with_its_float_path(quantized_gguf: Path) -> None:
    from kvpage import LLM

    kwargs = {"max_num_seqs": 4, "compilation_cache_dir": None, "max_model_len": 128}
    kept = LLM(str(quantized_gguf), **kwargs)
    assert is_quantized(kept.engine.runner.params["layers"][0]["self_attn"]["q_proj"]["weight"])
    dense = LLM(str(quantized_gguf), quantization="none", **kwargs)
    share, logprob_diff = agreement(greedy(kept, PROMPTS, 16), greedy(dense, PROMPTS, 16))
    print(f"tiny GGUF: greedy agreement {share:.0%}, mean |logprob diff| {logprob_diff:.2e}")
    assert share >= 0.9 and logprob_diff < 0.05


def test_int8_quantizes_a_float_checkpoint_at_load(tmp_path: Path) -> None:
    from kvpage import LLM

    model = build_hf_model("llama", seed=5, vocab_size=TOKENIZER_VOCAB, intermediate_size=256)
    path = save_hf_model(model, tmp_path / "hf")
    kwargs = {"max_num_seqs": 4, "compilation_cache_dir": None, "max_model_len": 128}
    int8 = LLM(str(path), quantization="int8", **kwargs)
    params = int8.engine.runner.params
    weight = params["layers"][0]["mlp"]["up_proj"]["weight"]
    assert weight.kind == "int8" and weight.blocks.dtype == jnp.int8
    assert weight.nbytes == 256 * 64 + 256 * 4  # a quarter of float32, plus row scales
    assert params["lm_head"]["weight"].kind == "int8"
    assert not is_quantized(params["norm"]["weight"])
    dense = LLM(str(path), **kwargs)
    share, logprob_diff = agreement(greedy(int8, PROMPTS, 16), greedy(dense, PROMPTS, 16))
    print(f"int8: greedy agreement {share:.0%}, mean |logprob diff| {logprob_diff:.2e}")
    assert share >= 0.9 and logprob_diff < 0.05


def test_int8_is_a_per_channel_round_trip() -> None:
    # Rows of int8 are blocks of 32 weights (the formats table), so 8 x the pattern.
    w = np.tile(np.array([[0.5, -1.0, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0]], np.float32), 8)
    q = quantize_int8(w)
    np.testing.assert_array_equal(q.blocks, np.tile([[64, -127, 32, 0], [0, 0, 0, 0]], 8))
    np.testing.assert_allclose(q.row_scales, [1.0 / 127, 0.0])
    np.testing.assert_allclose(np.asarray(q.dequantize()), w, atol=1 / 254)
    with pytest.raises(ValueError, match=r"\[out, in\] weights"):
        quantize_int8(np.zeros(4))
    with pytest.raises(ValueError, match="int8 weights need rows of a multiple of 32"):
        quantize_int8(np.ones((2, 4), np.float32))


def test_a_bad_quantization_mode_is_a_clear_error() -> None:
    from kvpage.engine.config import EngineConfig

    with pytest.raises(ValueError, match="quantization must be one of"):
        EngineConfig(model="m", quantization="q4")


def test_kernels_are_registered_for_every_format() -> None:
    for kind in cpu_qmatmul.KINDS:
        assert cpu_qmatmul.available(kind), kind


def test_real_smollm2_quantized_agrees_with_its_float_path() -> None:
    """On the README's Q4_1 file (when present): every stored tensor dequantizes
    bit-exactly, and greedy tokens of the quantized engine agree with kvpage's own
    dequantized float32 path on >= 90% of the first 32 tokens."""
    from kvpage import LLM
    from kvpage.model.gguf_file import GGUFFile
    from kvpage.model.real_models import find_smollm2

    path = find_smollm2()
    if path is None:
        pytest.skip("SmolLM2-135M-Instruct.Q4_1.gguf is not on this machine")
    for tensor in GGUFFile(path).tensors:
        kind = GGUF_KINDS.get(tensor.tensor_type.name)
        if kind is None or len(tensor.shape) != 2:
            continue
        inner = int(tensor.shape[0])
        got = np.asarray(dequantize_blocks(kind, jnp.asarray(np.asarray(tensor.data)), inner))
        want = reference_values(tensor.tensor_type.name, np.asarray(tensor.data))
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), tensor.name)
    kwargs = {"max_num_seqs": 8, "compilation_cache_dir": None, "max_model_len": 256}
    kept = LLM(str(path), **kwargs)
    tokenizer = kept.engine.tokenizer
    questions = ["What is the capital of France?", "Write a haiku about the sea.",
                 "List three prime numbers.", "Explain what a GPU is.",
                 "How do plants make food?", "Give me a synonym for happy.",
                 "What is 12 times 7?", "Name a famous painter."]
    prompts = [
        tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": q}],
                                                tokenize=False, add_generation_prompt=True))[
            "input_ids"]
        for q in questions
    ]
    batched = greedy(kept, prompts, 32)  # 8-row decode steps: the float-expansion path
    alone = [greedy(kept, [p], 32)[0] for p in prompts]  # 1-row steps: 16-bit inputs
    del kept
    dense = greedy(LLM(str(path), quantization="none", **kwargs), prompts, 32)
    for name, quantized in (("8 rows", batched), ("1 row", alone)):
        share, logprob_diff = agreement(quantized, dense)
        print(f"SmolLM2 Q4_1, {name}: greedy agreement {share:.0%}, "
              f"mean |logprob diff| {logprob_diff:.2e}")
        assert share >= 0.9, name


def test_vs_llama_cpp_bench_plans_the_same_requests_for_every_server(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from kvpage.bench.vs_llama_cpp import print_table, workloads

    plan = workloads([1, 4, 32], input_len=128, output_len=64, vocab=1000, seed=0)
    assert [len(plan[c]) for c in (1, 4, 32)] == [4, 8, 64]
    assert {len(r.prompt_token_ids) for r in plan[1]} == {128}
    assert plan == workloads([1, 4, 32], input_len=128, output_len=64, vocab=1000, seed=0)
    level = {"completed": 4, "failed": 0, "tpot_ms": 10.0, "errors": []}
    result = {
        "model": "m.gguf", "concurrency": [1],
        "servers": [
            {"server": "kvpage (auto)", "levels": {1: dict(level, output_tok_s=60.0)},
             "ready_s": 3.0, "rss_mib": 900.0},
            {"server": "llama.cpp", "levels": {1: dict(level, output_tok_s=80.0)},
             "ready_s": 1.0, "rss_mib": 100.0},
        ],
        "weights": {"resident_mib": 92.0, "file_mib": 92.0, "ratio": 1.0},
    }
    print_table(result)
    out = capsys.readouterr().out
    assert "0.75x" in out and "1.00x the file's 92.0 MiB" in out


def test_vs_llama_cpp_bench_runs_the_servers_in_turn_at_each_level() -> None:
    """Every server is ready before any level runs, then each level visits every
    server before the next level starts (the machine's drift hits both sides)."""
    import os
    from types import SimpleNamespace

    from kvpage.bench.vs_llama_cpp import run_servers

    calls: list[tuple[str, object]] = []

    class Stub:
        def __init__(self, name: str) -> None:
            self.name, self.result = name, {"levels": {}}
            self.proc = SimpleNamespace(pid=os.getpid())

        def wait_ready(self) -> None:
            calls.append((self.name, "ready"))

        def run_level(self, level: int, batch: list[object]) -> None:
            calls.append((self.name, level))

    servers = [Stub("kvpage"), Stub("llama.cpp")]
    run_servers(servers, {1: [], 4: [], 32: []})  # type: ignore[arg-type]
    assert calls == [("kvpage", "ready"), ("llama.cpp", "ready"),
                     ("kvpage", 1), ("llama.cpp", 1), ("kvpage", 4), ("llama.cpp", 4),
                     ("kvpage", 32), ("llama.cpp", 32)]
    assert all(s.result["rss_mib"] > 0 for s in servers)


def test_vs_llama_cpp_bench_refuses_a_model_that_is_not_gguf(tmp_path: Path) -> None:
    from kvpage.cli import main

    with pytest.raises(SystemExit, match="compares on a GGUF file"):
        main(["bench", "vs-llama-cpp", str(tmp_path)])


def test_kv_cache_dtype_auto_is_float16_for_quantized_weights_on_cpu(
    quantized_gguf: Path,
) -> None:
    """``kv_cache_dtype="auto"``: float16 pools under quantized weights on CPU (as
    llama.cpp keeps its cache), the weights' dtype otherwise; an explicit dtype wins."""
    from kvpage.engine.config import EngineConfig
    from kvpage.model.gguf_loader import load_gguf
    from kvpage.runner.kv_cache import resolve_kv_cache_dtype

    _, kept, _ = load_gguf(quantized_gguf, quantization="auto")
    _, dense, _ = load_gguf(quantized_gguf, quantization="none")
    assert resolve_kv_cache_dtype("auto", kept, "cpu") == "float16"
    assert resolve_kv_cache_dtype(None, kept, "cpu") == "float16"
    assert resolve_kv_cache_dtype("auto", dense, "cpu") == "float32"
    assert resolve_kv_cache_dtype("auto", kept, "gpu") == "float32"
    assert resolve_kv_cache_dtype("float32", kept, "cpu") == "float32"
    assert resolve_kv_cache_dtype("bfloat16", dense, "cpu") == "bfloat16"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(model="m", kv_cache_dtype="fp8")


def test_a_float16_kv_cache_agrees_with_a_float32_one(quantized_gguf: Path) -> None:
    """The same quantized engine with float16 pools (the default) and float32 pools:
    greedy tokens agree and logprobs stay close."""
    from kvpage import LLM

    kwargs = {"max_num_seqs": 4, "compilation_cache_dir": None, "max_model_len": 128}
    half = LLM(str(quantized_gguf), **kwargs)
    assert half.engine.runner.kv_pools[0][0].dtype == jnp.float16
    full = LLM(str(quantized_gguf), kv_cache_dtype="float32", **kwargs)
    assert full.engine.runner.kv_pools[0][0].dtype == jnp.float32
    share, logprob_diff = agreement(greedy(half, PROMPTS, 16), greedy(full, PROMPTS, 16))
    print(f"float16 vs float32 KV: greedy agreement {share:.0%}, "
          f"mean |logprob diff| {logprob_diff:.2e}")
    assert share >= 0.9 and logprob_diff < 0.01
