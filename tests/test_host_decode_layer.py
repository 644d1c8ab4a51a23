"""A decode step's decoder layer as one host custom call (``kvpage_decode_layer``):
equal to the traced layer for quantized, float and mixed weights; taken only where
the policy allows; in the engine, the same greedy tokens as the traced layers."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import numpy as np
import pytest
from gguf_fixtures import TOKENIZER_VOCAB, write_gguf
from kvpage.model import host_decode_layer
from kvpage.model.attention import get_attention_backend
from kvpage.model.gguf_loader import load_gguf
from kvpage.model.linear_kernels import host_matmuls
from kvpage.model.llama import AttentionMetadata, decoder_layer
from kvpage.quant import is_quantized
from model_fixtures import build_hf_model, save_hf_model
from test_quant import PROMPTS, agreement, greedy

from pallas_kernels import cpu_decode_layer

pytestmark = pytest.mark.skipif(
    not cpu_decode_layer.available(), reason="kvpage._core without the host layer"
)

# Formats the core reads, and one it does not keep (Q5_0: dequantized to float at load),
# so a layer mixes quantized and float weights.
QUANT = {
    "token_embd.weight": "Q8_0",
    "attn_q.weight": "Q8_0",
    "attn_k.weight": "Q4_1",
    "attn_v.weight": "Q4_0",
    "attn_output.weight": "Q4_1",
    "ffn_gate.weight": "Q8_0",
    "ffn_up.weight": "Q5_0",
    "blk.0.ffn_down.weight": "Q4_K",  # K-quants need rows of 256: only down_proj has them
    "blk.1.ffn_down.weight": "Q6_K",
}
BLOCK = 4


@pytest.fixture(autouse=True)
def _host_layer_on(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host layer is opt-in; these tests turn it on (the engine test sets both)."""
    monkeypatch.setenv("KVPAGE_CPU_DECODE_LAYER", "1")


@pytest.fixture(scope="module")
def gguf_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    model = build_hf_model("llama", seed=3, vocab_size=TOKENIZER_VOCAB, intermediate_size=256,
                           tie_word_embeddings=True)
    return write_gguf(tmp_path_factory.mktemp("layer") / "mixed.gguf", model, "llama",
                      quant=QUANT)


def decode_case(config: Any, rows: int, live: int, seed: int = 0) -> tuple[Any, ...]:
    """hidden, positions, pool and metadata of a decode step of ``rows`` rows, the first
    ``live`` of them sequences with history (the rest padding)."""
    rng = np.random.default_rng(seed)
    pages, width = 4 * rows + 1, 4
    shape = (config.num_kv_heads, pages, BLOCK, config.head_dim)
    pool = tuple(jnp.asarray(rng.normal(size=shape).astype(np.float32)) for _ in range(2))
    lens = [int(rng.integers(1, width * BLOCK + 1)) if r < live else 0 for r in range(rows)]
    tables = np.arange(rows * width, dtype=np.int32).reshape(rows, width)
    scratch = (pages - 1) * BLOCK
    slots = [tables[r, (n - 1) // BLOCK] * BLOCK + (n - 1) % BLOCK if n else scratch
             for r, n in enumerate(lens)]
    meta = AttentionMetadata(
        slot_mapping=jnp.asarray(slots, jnp.int32),
        block_tables=jnp.asarray(tables),
        kv_lens=jnp.asarray(lens, jnp.int32),
        cu_q_lens=jnp.arange(rows + 1, dtype=jnp.int32),
        num_seqs=jnp.asarray([live], jnp.int32),
    )
    hidden = jnp.asarray(rng.normal(size=(rows, config.hidden_size)).astype(np.float32))
    positions = jnp.asarray([max(n - 1, 0) for n in lens], jnp.int32)
    return hidden, positions, pool, meta


def run_layer(config: Any, layer: Any, case: tuple[Any, ...], decode_only: bool) -> Any:
    hidden, positions, pool, meta = case
    backend = get_attention_backend("xla")

    def step(layer: Any, hidden: jax.Array, pool: Any) -> Any:
        return decoder_layer(config, layer, hidden, positions, pool, meta, backend, decode_only)

    with host_matmuls():
        lowered = jax.jit(step).lower(layer, hidden, pool)
        out = lowered.compile()(layer, hidden, pool)
    return out, "kvpage_decode_layer" in lowered.as_text()


@pytest.mark.parametrize("quantization", ["auto", "none"])
@pytest.mark.parametrize("rows,live", [(1, 1), (4, 3), (8, 8)])
def test_the_host_layer_equals_the_traced_layer(
    gguf_path: Path, quantization: str, rows: int, live: int
) -> None:
    config, params, _ = load_gguf(gguf_path, tokenizer=False, quantization=quantization)
    for layer in params["layers"][:2]:  # down_proj Q4_K, then Q6_K
        assert is_quantized(layer["self_attn"]["q_proj"]["weight"]) == (quantization == "auto")
        case = decode_case(config, rows, live, seed=rows)
        (want, want_pool), traced = run_layer(config, layer, case, decode_only=False)
        (got, got_pool), fused = run_layer(config, layer, case, decode_only=True)
        assert fused and not traced
        # One row: both paths take the 16-bit integer products; the rest differs in the
        # order of float sums only. Quantized weights: a product's inputs are rounded to
        # 16 bits (steps of max/32767 per block), so a last-bit difference upstream can
        # move an input one step, ~3e-5 of the scale at the output.
        got_rows, want_rows = np.asarray(got)[:live], np.asarray(want)[:live]
        scale = float(np.abs(want_rows).max())
        atol = (1e-4 if quantization == "auto" else 2e-5) * scale
        np.testing.assert_allclose(got_rows, want_rows, rtol=2e-4, atol=atol)
        # Padding rows write the scratch (last) block, whose contents nobody reads: the
        # traced layer leaves those rows out of its quantized products.
        for g, w in zip(got_pool, want_pool, strict=True):
            np.testing.assert_allclose(
                np.asarray(g)[:, :-1], np.asarray(w)[:, :-1], rtol=1e-5, atol=1e-5
            )


def test_the_policy_keeps_what_the_core_cannot_run_traced(gguf_path: Path) -> None:
    config, params, _ = load_gguf(gguf_path, tokenizer=False)
    layer = params["layers"][0]
    # Float up_proj (Q5_0 is dequantized at load): as many rows as the float kernel takes.
    from pallas_kernels import cpu_matmul

    assert host_decode_layer.max_rows(config, layer, jnp.float32) == cpu_matmul.max_rows()
    assert host_decode_layer.max_rows(config, layer, jnp.bfloat16) == 0
    biased = {**layer, "self_attn": {**layer["self_attn"],
                                     "q_proj": {**layer["self_attn"]["q_proj"],
                                                "bias": jnp.zeros(config.q_size)}}}
    assert host_decode_layer.max_rows(config, biased, jnp.float32) == 0
    qk_norm = dataclasses.replace(config, qk_norm=True)
    assert host_decode_layer.max_rows(qk_norm, layer, jnp.float32) == 0
    too_many = decode_case(config, cpu_matmul.max_rows() + 1, 1)
    (_, _), fused = run_layer(config, layer, too_many, decode_only=True)
    assert not fused


def test_a_bad_slot_is_a_clear_error(gguf_path: Path) -> None:
    config, params, _ = load_gguf(gguf_path, tokenizer=False)
    hidden, positions, pool, meta = decode_case(config, 1, 1)
    bad = meta._replace(slot_mapping=jnp.asarray([10**6], jnp.int32))
    with pytest.raises(Exception, match="slot 1000000 outside the pool"):
        out = run_layer(config, params["layers"][0], (hidden, positions, pool, bad), True)
        jax.block_until_ready(out)


@pytest.mark.parametrize("source", ["gguf", "int8", "float"])
def test_the_engine_decodes_the_same_tokens_with_and_without_it(
    source: str, gguf_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvpage import LLM

    kwargs: dict[str, Any] = {"max_num_seqs": 4, "compilation_cache_dir": None,
                              "max_model_len": 128}
    path = str(gguf_path)
    if source != "gguf":
        model = build_hf_model("llama", seed=5, vocab_size=TOKENIZER_VOCAB,
                               intermediate_size=256)
        path = str(save_hf_model(model, tmp_path / "hf"))
        kwargs["quantization"] = "int8" if source == "int8" else "none"
    engines = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("KVPAGE_CPU_DECODE_LAYER", flag)
        engines[flag] = LLM(path, **kwargs)
    runner = engines["1"].engine.runner
    assert runner._host_decode_rows > 0 and engines["0"].engine.runner._host_decode_rows == 0
    fused, traced = greedy(engines["1"], PROMPTS, 16), greedy(engines["0"], PROMPTS, 16)
    assert any(key[2] for key in runner.compiled_buckets), "no pure-decode bucket ran"
    share, logprob_diff = agreement(fused, traced)
    print(f"{source}: greedy agreement {share:.0%}, mean |logprob diff| {logprob_diff:.2e}")
    assert share >= 0.9 and logprob_diff < 1e-3
