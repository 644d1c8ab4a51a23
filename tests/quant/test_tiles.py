"""Q4_0 / Q4_1 weights packed into tiles of sixteen rows for the CPU kernels
(``kvpage.quant.tiles``, ``kvpage.quant.packing``): the layout Rust's ``pack_tiles``
describes, undone exactly in the step, and engines whose weights are packed (a MoE and a
dense model) generating the same tokens and logprobs as ones that keep GGUF's row order:
bit for bit with AVX-512 VNNI, where one kernel reads both layouts; with AVX2 alone the
rows keep the row-at-a-time kernel, so the two agree to the integer path's rounding."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import numpy as np
import pytest
from kvpage.quant.tiles import PACKED_KINDS, can_pack, pack_tiles, unpack_tiles
from kvpage.quant.weights import QuantizedWeight

NO_PACKED_KERNEL = "this CPU has no kernel for packed tiles (AVX2 or AVX-512 VNNI)"


def same_bits(kind: str) -> bool:
    """Whether packed weights give their rows' bits here (the core's lanes kernel reads
    both layouts: AVX-512 VNNI, where products of any row count take the integer path)."""
    from kvpage.kernels.host.cpu_qmatmul import integer_blocks

    return integer_blocks(kind)


def assert_agree(got: np.ndarray, want: np.ndarray, kind: str) -> None:
    """Equal bits where :func:`same_bits`, else equal to the integer path's rounding
    (16-bit inputs: ~1.5e-5 of each input) relative to the largest magnitude."""
    if same_bits(kind):
        np.testing.assert_array_equal(got, want)
    else:
        scale = max(float(np.abs(want).max()), 1e-3)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-4 * scale)

SMALL = dict(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, experts=8, top_k=2,
             expert_width=32, vocab=512, context=256)


def random_blocks(kind: str, shape: tuple[int, ...], seed: int = 0) -> np.ndarray:
    *lead, outs, inner = shape
    bb = PACKED_KINDS[kind]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (*lead, outs, inner // 32, bb), dtype=np.uint8)
    fields = rng.uniform(0.001, 0.01, (*lead, outs, inner // 32, (bb - 16) // 2))
    blocks[..., : bb - 16] = fields.astype(np.float16).view(np.uint8).reshape(
        *fields.shape[:-1], bb - 16)
    return blocks.reshape(*lead, outs, inner // 32 * bb)


@pytest.mark.parametrize("kind", ["q4_0", "q4_1"])
def test_packing_is_the_kernel_layout_and_unpacks_exactly(kind: str) -> None:
    rows = random_blocks(kind, (3, 48, 128))
    packed = pack_tiles(kind, rows)
    assert packed.shape == rows.shape and packed.dtype == np.uint8
    np.testing.assert_array_equal(np.asarray(unpack_tiles(kind, jnp.asarray(packed))), rows)
    # Per tile and block: each f16 field of the sixteen rows, then register q, row o:
    # bytes 4q..4q+4 of the nibbles.
    bb = PACKED_KINDS[kind]
    head, nb = bb - 16, rows.shape[-1] // bb
    for e, tile, b, o, q in [(0, 0, 0, 0, 0), (2, 1, 3, 15, 3), (1, 2, 2, 7, 1)]:
        src = rows[e, 16 * tile + o, bb * b:bb * (b + 1)]
        at = (tile * nb + b) * 16 * bb
        dst = packed[e].reshape(-1)
        for field in range(head // 2):
            got = dst[at + 32 * field + 2 * o:at + 32 * field + 2 * o + 2]
            np.testing.assert_array_equal(got, src[2 * field:2 * field + 2])
        nib = at + 16 * head + 64 * q + 4 * o
        np.testing.assert_array_equal(dst[nib:nib + 4], src[head + 4 * q:head + 4 * q + 4])


def test_a_packed_weight_dequantizes_as_its_rows() -> None:
    rows = random_blocks("q4_1", (2, 32, 64), seed=3)
    plain = QuantizedWeight(jnp.asarray(rows), "q4_1", (2, 32, 64))
    packed = QuantizedWeight(jnp.asarray(pack_tiles("q4_1", rows)), "q4_1", (2, 32, 64),
                             layout="tiles16")
    np.testing.assert_array_equal(np.asarray(packed.dequantize()), np.asarray(plain.dequantize()))
    assert "tiles16" in repr(packed)
    with pytest.raises(ValueError, match="cannot be in layout"):
        QuantizedWeight(jnp.asarray(rows[..., :-2]), "q8_0", (2, 32, 64), layout="tiles16")
    with pytest.raises(ValueError, match="row order"):
        packed.take_rows(jnp.asarray([0]))


@pytest.mark.parametrize("kind", ["q4_0", "q4_1"])
@pytest.mark.parametrize("rows", [1, 6, 40, 600])
def test_packed_products_equal_their_rows_on_every_path(kind: str, rows: int) -> None:
    """One weight and a q/k/v group, packed or not, through ``matmul_nt`` / ``linears``
    with the host kernels on: the same results (:func:`assert_agree`; 600 rows: the
    dequantize path, the same bits everywhere)."""
    import jax
    from kvpage.model.linear import linears
    from kvpage.model.linear_kernels import host_matmuls

    if not can_pack(kind, 16):
        pytest.skip(NO_PACKED_KERNEL)
    shapes = [(48, 64), (16, 64), (16, 64)]
    plain = [QuantizedWeight(jnp.asarray(random_blocks(kind, s, i)), kind, s)
             for i, s in enumerate(shapes)]
    packed = [QuantizedWeight(jnp.asarray(pack_tiles(kind, np.asarray(w.blocks))), kind,
                              w.shape, layout="tiles16") for w in plain]
    x = jnp.asarray(np.random.default_rng(rows).standard_normal((rows, 64)).astype(np.float32))

    def run(ws: list[QuantizedWeight]) -> list[np.ndarray]:
        with host_matmuls(True):
            f = jax.jit(lambda x: [*linears(x, [{"weight": w} for w in ws]),
                                   *linears(x, [{"weight": ws[0]}])])
            return [np.asarray(y) for y in f(x)]

    for got, want in zip(run(packed), run(plain), strict=True):
        if rows >= 600:
            np.testing.assert_array_equal(got, want)
        else:
            assert_agree(got, want, kind)


def assert_logprobs_agree(got: list, want: list, kind: str) -> None:
    """The same logprobs: bit for bit where :func:`same_bits`, else within 5e-3 (a
    random model's logits amplify the rounding: 1.7e-3 seen on a Zen 3, 2026-11-29)."""
    if same_bits(kind):
        assert got == want
    else:
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=0, atol=5e-3)


def _generate(path: Path, monkeypatch: pytest.MonkeyPatch, pack: bool
              ) -> tuple[list, list, dict]:
    """Greedy tokens and their logprobs of five prompts, and the engine's params."""
    from kvpage import LLM, SamplingParams

    monkeypatch.setenv("KVPAGE_PACK_WEIGHTS", "1" if pack else "0")
    llm = LLM(str(path), max_model_len=64, max_num_seqs=8, num_gpu_blocks=64, block_size=8)
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(0, 200, 5 + i).tolist()} for i in range(5)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    out = llm.generate(prompts, params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in out]
    logprobs = [[next(iter(d.values())).logprob for d in o.outputs[0].logprobs] for o in out]
    return tokens, logprobs, llm.engine.runner.params


def test_an_engine_with_packed_experts_generates_the_same_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvpage.bench.moe_model import MoEShape, write_random_moe_gguf

    if not can_pack("q4_0", 32):
        pytest.skip(NO_PACKED_KERNEL)
    path = write_random_moe_gguf(tmp_path / "moe.gguf", MoEShape(**SMALL))

    def layouts(params: dict) -> set[str]:
        experts = params["layers"][0]["mlp"]["experts"]["gate_proj"]["weight"]
        return {experts.layout, params["lm_head"]["weight"].layout}  # 512 x 64: whole tiles

    tokens, logprobs, params = _generate(path, monkeypatch, pack=True)
    assert layouts(params) == {"tiles16"}
    rows_tokens, rows_logprobs, rows_params = _generate(path, monkeypatch, pack=False)
    assert layouts(rows_params) == {"rows"}
    assert tokens == rows_tokens
    assert_logprobs_agree(logprobs, rows_logprobs, "q4_0")


def test_a_dense_engine_with_packed_projections_generates_the_same_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """q/k/v in Q4_0 (one packed call), gate/up in Q4_1 packed; the Q8_0 embedding and
    down projection, and an lm_head of a vocabulary that is not whole tiles, stay in
    rows (bench moe's model has an untied Q4_0 lm_head of whole tiles, packed: the MoE
    test above)."""
    from gguf_fixtures import TOKENIZER_VOCAB, write_gguf
    from model_fixtures import build_hf_model

    if not can_pack("q4_0", 16):
        pytest.skip(NO_PACKED_KERNEL)
    model = build_hf_model("llama", seed=5, vocab_size=TOKENIZER_VOCAB, intermediate_size=128,
                           tie_word_embeddings=False, num_hidden_layers=2)
    quant = {"token_embd.weight": "Q8_0", "attn_q.weight": "Q4_0", "attn_k.weight": "Q4_0",
             "attn_v.weight": "Q4_0", "attn_output.weight": "Q4_1",
             "ffn_gate.weight": "Q4_1", "ffn_up.weight": "Q4_1", "ffn_down.weight": "Q8_0",
             "output.weight": "Q4_0"}
    path = write_gguf(tmp_path / "dense.gguf", model, "llama", quant=quant)

    def layouts(params: dict) -> dict[str, str]:
        layer = params["layers"][0]
        return {"q": layer["self_attn"]["q_proj"]["weight"].layout,
                "up": layer["mlp"]["up_proj"]["weight"].layout,
                "down": layer["mlp"]["down_proj"]["weight"].layout,
                "lm_head": params["lm_head"]["weight"].layout,
                "embed": params["embed_tokens"]["weight"].layout}

    tokens, logprobs, params = _generate(path, monkeypatch, pack=True)
    lm_head = "tiles16" if TOKENIZER_VOCAB % 16 == 0 else "rows"
    assert layouts(params) == {"q": "tiles16", "up": "tiles16", "down": "rows",
                               "lm_head": lm_head, "embed": "rows"}
    rows_tokens, rows_logprobs, rows_params = _generate(path, monkeypatch, pack=False)
    assert set(layouts(rows_params).values()) == {"rows"}
    assert tokens == rows_tokens
    assert_logprobs_agree(logprobs, rows_logprobs, "q4_0")


def test_experts_no_one_host_call_reads_stay_in_rows() -> None:
    """Only the one MoE host call reads experts packed; where it does not apply (expert
    biases, a clamped activation, ...) packing them would cost an unpack every step."""
    from kvpage.quant.packing import pack_weights

    if not can_pack("q4_0", 32):
        pytest.skip(NO_PACKED_KERNEL)

    def weight(shape: tuple[int, ...]) -> dict:
        return {"weight": QuantizedWeight(jnp.asarray(random_blocks("q4_0", shape)), "q4_0",
                                          shape)}

    def params() -> dict:
        mlp = {"experts": {"gate_proj": weight((4, 32, 64)), "up_proj": weight((4, 32, 64)),
                           "down_proj": weight((4, 64, 32))}}
        return {"layers": [{"self_attn": {"q_proj": weight((64, 64))}, "mlp": mlp}]}

    kept = params()
    assert pack_weights(kept, lambda mlp: False) == 1  # q_proj only
    assert kept["layers"][0]["mlp"]["experts"]["gate_proj"]["weight"].layout == "rows"
    packed = params()
    assert pack_weights(packed) == 4
    assert packed["layers"][0]["mlp"]["experts"]["down_proj"]["weight"].layout == "tiles16"
