"""The host mixture-of-experts product (Rust, called by XLA as an FFI custom call):
``y[n] = x[n] . W[expert_ids[n]]^T`` against a numpy reference built from each format's
own dequantization, for quantized (Q4_K, Q4_0, Q8_0, int8, ...) and float32 / bfloat16
experts; a row alone on its expert equal to the dense kernel's one-row product; padding
rows; bad expert ids and shapes as errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import numpy as np
import pytest
from gguf_fixtures import random_blocks
from kvpage.kernels.host import cpu_expert_matmul, cpu_qmatmul
from kvpage.quant import QuantizedWeight, formats
from kvpage.quant.int8 import quantize_int8

pytestmark = pytest.mark.skipif(
    not cpu_expert_matmul.available("q4_k"), reason="kvpage._core without the expert kernels"
)

EXPERTS, INNER, OUTS = 6, 512, 40
GGUF_NAMES = {kind: gguf for gguf, kind in formats.GGUF_KEPT.items()}


def stacked_experts(kind: str, seed: int) -> QuantizedWeight:
    """``EXPERTS`` quantized ``[OUTS, INNER]`` experts as one ``[EXPERTS * OUTS, INNER]``
    weight (gguf-py quantizes the simple formats; K-quants are random blocks)."""
    shape = (EXPERTS * OUTS, INNER)
    values = np.random.default_rng(seed).standard_normal(shape).astype(np.float32) * 0.05
    if kind == "int8":
        return jax.device_put(quantize_int8(values))
    name = GGUF_NAMES[kind]
    if name in ("Q8_0", "Q4_0", "Q4_1"):
        import gguf
        from gguf.quants import quantize

        blocks = quantize(values, gguf.GGMLQuantizationType[name])
    else:
        blocks = random_blocks(shape, name, seed)
    return QuantizedWeight(jnp.asarray(blocks), kind, shape)


def reference(x: np.ndarray, experts: np.ndarray, ids: np.ndarray, live: int) -> np.ndarray:
    """``x[n] . experts[ids[n]]^T`` in float64 for the live rows, zeros after."""
    y = np.zeros((x.shape[0], experts.shape[1]))
    for n in range(live):
        y[n] = x[n].astype(np.float64) @ experts[ids[n]].astype(np.float64).T
    return y


def inputs(rows: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, INNER)).astype(np.float32)


def run_quantized(weight: QuantizedWeight, x, ids, live=None) -> np.ndarray:
    fn = jax.jit(
        lambda x, ids, live: cpu_expert_matmul.expert_qmatmul_call(
            x, weight.blocks, weight.row_scales, weight.kind, ids, EXPERTS, live
        )
    )
    return np.asarray(fn(jnp.asarray(x), jnp.asarray(ids, jnp.int32), live))


# One token's top-4 (decode); 16 tokens' top-2 with experts shared and some unused.
ROUTINGS = {
    "decode_top4": np.array([4, 0, 5, 2]),
    "batch": np.random.default_rng(3).integers(0, EXPERTS - 1, 32),
}


@pytest.mark.parametrize("kind", formats.KINDS)
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_quantized_experts_match_dequantize_then_matmul(kind: str, routing: str) -> None:
    assert cpu_expert_matmul.available(kind)
    weight = stacked_experts(kind, seed=len(routing))
    ids = ROUTINGS[routing]
    x = inputs(len(ids), seed=7)
    got = run_quantized(weight, x, ids)
    experts = np.asarray(weight.dequantize()).reshape(EXPERTS, OUTS, INNER)
    want = reference(x, experts, ids, len(ids))
    assert got.shape == want.shape and got.dtype == np.float32
    # A row alone on its expert takes 16-bit inputs (relative error ~1e-5).
    assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max()


@pytest.mark.parametrize("kind", ["q4_k", "q8_0", "int8"])
def test_a_row_alone_on_its_expert_is_the_dense_one_row_product(kind: str) -> None:
    assert cpu_qmatmul.available(kind)  # registers the dense kernel
    weight = stacked_experts(kind, seed=11)
    ids = ROUTINGS["decode_top4"]
    x = inputs(len(ids), seed=12)
    got = run_quantized(weight, x, ids)
    blocks = np.asarray(weight.blocks)
    scales = None if weight.row_scales is None else np.asarray(weight.row_scales)
    for n, e in enumerate(ids):
        rows = slice(e * OUTS, (e + 1) * OUTS)
        dense = cpu_qmatmul.qmatmul_call(
            jnp.asarray(x[n : n + 1]),
            jnp.asarray(blocks[rows]),
            None if scales is None else jnp.asarray(scales[rows]),
            kind,
        )
        np.testing.assert_array_equal(got[n], np.asarray(dense)[0])


def test_padding_rows_are_zeros_and_their_ids_are_never_read() -> None:
    weight = stacked_experts("q4_k", seed=13)
    ids = np.array([1, 3, 3, 0, 99, -5, 1000, 2])
    x = inputs(len(ids), seed=14)
    experts = np.asarray(weight.dequantize()).reshape(EXPERTS, OUTS, INNER)
    for live in (0, 2, 4):
        got = run_quantized(weight, x, ids, live)
        want = reference(x, experts, ids, live)
        assert not got[live:].any()
        assert np.abs(got - want).max() <= 1e-4 * max(np.abs(want).max(), 1.0)
        full = run_quantized(weight, x[:live], ids[:live]) if live else got[:0]
        np.testing.assert_array_equal(got[:live], full)


def test_an_expert_id_out_of_range_is_an_error() -> None:
    weight = stacked_experts("q4_0", seed=15)
    x = inputs(3, seed=16)
    for bad in (EXPERTS, -1):
        with pytest.raises(Exception, match="expert id"):
            run_quantized(weight, x, np.array([0, bad, 1]))
    w = jnp.zeros((EXPERTS, OUTS, INNER), jnp.float32)
    with pytest.raises(Exception, match="expert id"):
        np.asarray(cpu_expert_matmul.expert_matmul_call(jnp.asarray(x), w, jnp.array([0, 1, 6])))
    with pytest.raises(Exception, match="live_rows"):
        run_quantized(weight, x, np.array([0, 1, 2]), 4)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("routing", list(ROUTINGS))
def test_float_experts_match_numpy(dtype: str, routing: str) -> None:
    assert cpu_expert_matmul.available(dtype)
    rng = np.random.default_rng(17)
    w = jnp.asarray(rng.standard_normal((EXPERTS, OUTS, INNER)).astype(np.float32) * 0.05)
    w = w.astype(dtype)
    ids = ROUTINGS[routing]
    x = inputs(len(ids), seed=18)
    got = np.asarray(
        jax.jit(cpu_expert_matmul.expert_matmul_call)(jnp.asarray(x), w, jnp.asarray(ids))
    )
    want = reference(x, np.asarray(w.astype(jnp.float32)), ids, len(ids))
    assert got.dtype == np.float32
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max() * np.sqrt(INNER)
    live = 1
    part = np.asarray(cpu_expert_matmul.expert_matmul_call(jnp.asarray(x), w, ids, live))
    np.testing.assert_array_equal(part[:live], got[:live])
    assert not part[live:].any()


def test_the_lowered_program_calls_the_target_and_shapes_are_checked() -> None:
    weight = stacked_experts("q8_0", seed=19)
    x = jnp.asarray(inputs(4, seed=20))
    ids = jnp.asarray(ROUTINGS["decode_top4"], jnp.int32)

    def step(x: jax.Array, ids: jax.Array) -> jax.Array:
        return cpu_expert_matmul.expert_qmatmul_call(
            x, weight.blocks, None, "q8_0", ids.reshape(2, 2), EXPERTS
        )

    assert "kvpage_expert_qmatmul_q8_0" in jax.jit(step).lower(x, ids).as_text()
    with pytest.raises(ValueError, match="blocks of 7 experts"):
        cpu_expert_matmul.expert_qmatmul_call(x, weight.blocks, None, "q8_0", ids, 7)
    with pytest.raises(ValueError, match="row_scales"):
        cpu_expert_matmul.expert_qmatmul_call(
            x, jnp.zeros((EXPERTS * OUTS, INNER), jnp.int8), None, "int8", ids, EXPERTS
        )
    with pytest.raises(ValueError, match="one id per row"):
        cpu_expert_matmul.expert_qmatmul_call(x, weight.blocks, None, "q8_0", ids[:3], EXPERTS)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        cpu_expert_matmul.expert_matmul_call(x, jnp.zeros((2, 3, INNER), jnp.float16), ids)
    targets = set(cpu_expert_matmul.targets())
    assert targets >= {"kvpage_expert_matmul", "kvpage_expert_qmatmul_int8"}
    assert not cpu_expert_matmul.available("q5_k")
