"""Weight loading: safetensors (single, sharded, bf16), in-memory pytrees, random params, errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import numpy as np
import pytest
from kvpage.model import (
    CheckpointError,
    load_model,
    param_spec,
    params_from_hf_tensors,
    params_from_pytree,
    preset,
    random_params,
)
from kvpage.model.params import hf_name_to_path, iter_leaves
from kvpage.model.safetensors_file import SafetensorsFile
from model_fixtures import build_hf_model, prefill_logits, save_hf_model

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path]:
    model = build_hf_model("qwen2", seed=5)
    return model, save_hf_model(model, tmp_path_factory.mktemp("qwen2"))


def hf_state(model: Any) -> dict[str, np.ndarray]:
    return {k: v.detach().float().numpy() for k, v in model.state_dict().items()}


def leaves_by_name(config: Any, params: Any) -> dict[str, np.ndarray]:
    return {name: np.asarray(v, np.float32) for name, v, _ in iter_leaves(config, params)}


def test_loaded_tensors_equal_hf_state_dict(qwen2: tuple[Any, Path]) -> None:
    model, directory = qwen2
    config, params = load_model(directory)
    state = hf_state(model)
    loaded = leaves_by_name(config, params)
    assert set(loaded) == set(param_spec(config))
    for name, value in loaded.items():
        np.testing.assert_array_equal(value, state[name], err_msg=name)
    assert params["layers"][1]["self_attn"]["q_proj"]["bias"].dtype == jnp.float32


def test_sharded_checkpoint_loads_identically(qwen2: tuple[Any, Path], tmp_path: Path) -> None:
    model, directory = qwen2
    save_hf_model(model, tmp_path, max_shard_size="60KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    config, single = load_model(directory)
    _, sharded = load_model(tmp_path)
    a, b = leaves_by_name(config, single), leaves_by_name(config, sharded)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])


def test_bfloat16_checkpoint(tmp_path: Path) -> None:
    import torch

    model = build_hf_model("llama", seed=2, dtype=torch.bfloat16)
    save_hf_model(model, tmp_path)
    config, params = load_model(tmp_path)  # "auto" -> the checkpoint's bfloat16
    assert config.dtype == "bfloat16"
    assert params["embed_tokens"]["weight"].dtype == jnp.bfloat16
    _, upcast = load_model(tmp_path, dtype="float32")
    assert upcast["norm"]["weight"].dtype == jnp.float32
    state = hf_state(model)
    for name, value in leaves_by_name(config, upcast).items():
        np.testing.assert_array_equal(value, state[name], err_msg=name)
    np.testing.assert_array_equal(
        np.asarray(params["lm_head"]["weight"], np.float32), state["lm_head.weight"]
    )


def test_tied_checkpoint_and_hf_name_mapping(tmp_path: Path) -> None:
    model = build_hf_model("llama", seed=4, tie_word_embeddings=True)
    save_hf_model(model, tmp_path)
    config, params = load_model(tmp_path)
    assert config.tie_word_embeddings and "lm_head" not in params
    assert hf_name_to_path("model.layers.3.mlp.up_proj.weight") == (
        "layers", 3, "mlp", "up_proj", "weight")
    from_state = params_from_hf_tensors(config, hf_state(model))
    a, b = leaves_by_name(config, params), leaves_by_name(config, from_state)
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])


def test_stacked_layer_layout_gives_same_logits(qwen2: tuple[Any, Path]) -> None:
    model, directory = qwen2
    config, params = load_model(directory)
    stacked = {
        **{k: v for k, v in params.items() if k != "layers"},
        "layers": jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *params["layers"]),
    }
    stacked = params_from_pytree(config, stacked)
    from model_fixtures import hf_logits

    np.testing.assert_allclose(
        prefill_logits(config, stacked, PROMPT), hf_logits(model, PROMPT), rtol=1e-4, atol=1e-4
    )


def test_params_from_pytree_validation(qwen2: tuple[Any, Path]) -> None:
    _, directory = qwen2
    config, params = load_model(directory)
    numpy_tree = jax.tree_util.tree_map(np.asarray, params)
    converted = params_from_pytree(config, numpy_tree, dtype="bfloat16")
    assert converted["norm"]["weight"].dtype == jnp.bfloat16

    missing = jax.tree_util.tree_map(lambda x: x, params)
    del missing["layers"][1]["mlp"]["up_proj"]
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        params_from_pytree(config, missing)

    wrong = jax.tree_util.tree_map(lambda x: x, params)
    wrong["norm"]["weight"] = jnp.ones(3)
    with pytest.raises(CheckpointError, match="model.norm.weight"):
        params_from_pytree(config, wrong)

    extra = jax.tree_util.tree_map(lambda x: x, params)
    extra["layers"][0]["mlp"]["gate_proj"]["kernel"] = jnp.ones(3)
    with pytest.raises(CheckpointError, match="unexpected"):
        params_from_pytree(config, extra)

    with pytest.raises(CheckpointError, match="layers"):
        params_from_pytree(config, {**params, "layers": params["layers"][:1]})


def test_random_params_real_shapes() -> None:
    config = preset("qwen3-0.6b").with_overrides(num_layers=1, vocab_size=1024)
    params = random_params(config, seed=0, dtype="bfloat16")
    params_from_pytree(config, params)  # validates every shape
    assert params["layers"][0]["self_attn"]["q_proj"]["weight"].shape == (2048, 1024)
    assert params["layers"][0]["self_attn"]["q_norm"]["weight"].dtype == jnp.bfloat16
    again = random_params(config, seed=0, dtype="bfloat16")
    np.testing.assert_array_equal(
        np.asarray(params["embed_tokens"]["weight"], np.float32),
        np.asarray(again["embed_tokens"]["weight"], np.float32),
    )


def test_loader_errors(qwen2: tuple[Any, Path], tmp_path: Path) -> None:
    _, directory = qwen2
    with pytest.raises(CheckpointError, match="not found"):
        load_model(tmp_path / "missing")

    def fresh(name: str) -> Path:
        target = tmp_path / name
        shutil.copytree(directory, target)
        return target

    no_weights = fresh("no_weights")
    (no_weights / "model.safetensors").rename(no_weights / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="pickle"):
        load_model(no_weights)

    truncated = fresh("truncated")
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="malformed"):
        load_model(truncated)

    garbage = fresh("garbage")
    (garbage / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(CheckpointError, match="not JSON"):
        load_model(garbage)

    wrong_config = fresh("wrong_shape")
    raw = json.loads((wrong_config / "config.json").read_text())
    raw["intermediate_size"] = 96
    (wrong_config / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match="mlp.gate_proj.weight.*shape"):
        load_model(wrong_config)

    more_layers = fresh("more_layers")
    raw = json.loads((more_layers / "config.json").read_text())
    raw["num_hidden_layers"] = 3
    (more_layers / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=r"lacks tensors: model\.layers\.2\."):
        load_model(more_layers)

    bad_index = fresh("bad_index")
    (bad_index / "model.safetensors.index.json").write_text('{"weight_map": 3}')
    with pytest.raises(CheckpointError, match="weight index"):
        load_model(bad_index)

    with pytest.raises(ValueError, match="float8"):
        load_model(directory, dtype="float8")


def test_safetensors_reader_views(qwen2: tuple[Any, Path]) -> None:
    model, directory = qwen2
    reader = SafetensorsFile(directory / "model.safetensors")
    name = "model.layers.0.self_attn.k_proj.bias"
    assert name in reader and reader.shape(name) == (32,)
    np.testing.assert_array_equal(reader.get(name), hf_state(model)[name])
    with pytest.raises(CheckpointError, match="not found"):
        reader.get("nope")


def test_auto_dtype_downcasts_float32_on_accelerators() -> None:
    from kvpage.model.loader import auto_dtype_for_platform

    assert auto_dtype_for_platform("float32", "gpu") == "bfloat16"
    assert auto_dtype_for_platform("float32", "tpu") == "bfloat16"
    assert auto_dtype_for_platform("float32", "cpu") == "float32"
    assert auto_dtype_for_platform("float16", "gpu") == "float16"
    assert auto_dtype_for_platform("bfloat16", "gpu") == "bfloat16"


def test_load_model_auto_on_gpu_runs_bf16_and_logs(tmp_path: Path, monkeypatch: Any,
                                                    caplog: Any) -> None:
    import logging

    from kvpage.model import loader
    from kvpage.model.tiny_model import build_tiny_model

    directory = build_tiny_model(tmp_path / "m")
    config, _ = load_model(directory)
    assert config.dtype == "float32"  # on CPU the checkpoint's dtype stays
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    with caplog.at_level(logging.INFO, logger=loader.__name__):
        config, params = load_model(directory)
    assert config.dtype == "bfloat16"
    assert params["embed_tokens"]["weight"].dtype == jnp.bfloat16
    assert "runs in bfloat16 on gpu" in caplog.text
    config, params = load_model(directory, dtype="float32")
    assert config.dtype == "float32" and params["embed_tokens"]["weight"].dtype == jnp.float32


def test_gguf_auto_dtype_float32_file_runs_bf16_on_accelerators() -> None:
    from types import SimpleNamespace

    from kvpage.model.gguf_loader import _auto_dtype

    def reader(*kinds: str) -> Any:
        return SimpleNamespace(tensors=[SimpleNamespace(tensor_type=SimpleNamespace(name=k),
                                                        shape=(4, 4)) for k in kinds])

    gpu, cpu = SimpleNamespace(platform="gpu"), SimpleNamespace(platform="cpu")
    assert _auto_dtype(reader("F32"), gpu) == "bfloat16"
    assert _auto_dtype(reader("F32"), cpu) == "float32"
    assert _auto_dtype(reader("F16"), gpu) == "float16"
    assert _auto_dtype(reader("Q4_1", "F32"), gpu) == "bfloat16"
