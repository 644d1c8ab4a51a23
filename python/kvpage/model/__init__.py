"""kvpage.model: the Llama-family decoder as pure JAX functions, its config and weight loading.

* :mod:`~kvpage.model.config`   -- :class:`ModelConfig` from an HF ``config.json``.
* :mod:`~kvpage.model.presets`  -- well-known shapes for random-weight benchmarks.
* :mod:`~kvpage.model.params`   -- the documented parameter pytree layout.
* :mod:`~kvpage.model.loader`   -- safetensors loading, random params, in-memory params.
* :mod:`~kvpage.model.gguf_loader` -- GGUF files: config, dequantized params, tokenizer.
* :mod:`~kvpage.model.real_models` -- finding or fetching the SmolLM2 GGUF of the benchmarks.
* :mod:`~kvpage.model.decoder`    -- the forward pass over a ragged batch and paged KV.
* :mod:`~kvpage.model.dense`    -- the same decoder, dense and causal, for training.
* :mod:`~kvpage.model.attention` -- which paged-attention kernel the forward pass calls.
* :mod:`~kvpage.model.rope`     -- rotary embeddings (default, linear, llama3).
* :mod:`~kvpage.model.safetensors_file` -- strict memory-mapped safetensors reader.
* :mod:`~kvpage.model.errors`   -- :class:`CheckpointError`.
"""

from kvpage.model.attention import AttentionBackend, get_attention_backend
from kvpage.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, RopeConfig
from kvpage.model.decoder import AttentionMetadata, compute_logits, forward
from kvpage.model.errors import CheckpointError
from kvpage.model.gguf_loader import load_gguf, read_gguf_config
from kvpage.model.loader import (
    load_model,
    load_params,
    params_from_hf_tensors,
    params_from_pytree,
    random_params,
)
from kvpage.model.params import Params, param_spec, validate_params
from kvpage.model.presets import PRESETS, preset

__all__ = [
    "PRESETS",
    "SUPPORTED_ARCHITECTURES",
    "AttentionBackend",
    "AttentionMetadata",
    "CheckpointError",
    "ModelConfig",
    "Params",
    "RopeConfig",
    "compute_logits",
    "forward",
    "get_attention_backend",
    "load_gguf",
    "load_model",
    "load_params",
    "param_spec",
    "params_from_hf_tensors",
    "params_from_pytree",
    "preset",
    "random_params",
    "read_gguf_config",
    "validate_params",
]
