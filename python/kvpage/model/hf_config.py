"""Reading the Hugging Face ``config.json`` dialects: the fields every architecture shares.

This file owns the translation of the fields common to the decoder-only architectures
(transformers 4 ``rope_theta`` + ``rope_scaling``, transformers 5 ``rope_parameters``;
``torch_dtype`` or ``dtype``; ``layer_types`` or a sliding-window pattern) into
:class:`~kvpage.model.config.ModelConfig` keyword arguments. Each architecture file in
:mod:`kvpage.model.architectures` starts from :func:`decoder_fields` and adds or
overrides what is its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpage.model.config_types import (
    FULL_ATTENTION,
    LAYER_TYPES,
    SLIDING_ATTENTION,
    SUPPORTED_DTYPES,
    SUPPORTED_ROPE_TYPES,
    RopeConfig,
)


def _unsupported_rope_message(rope_type: Any) -> str:
    return f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"


def _rope_parameters(raw: Mapping[str, Any], layer_type: str) -> Mapping[str, Any]:
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"rope parameters must be an object, got {params!r}")
    if FULL_ATTENTION in params or SLIDING_ATTENTION in params:
        # transformers 5 writes one set per layer kind (Gemma 3).
        params = params.get(layer_type) or params.get(FULL_ATTENTION) or {}
        if not isinstance(params, Mapping):
            raise ValueError(f"rope parameters must be an object, got {params!r}")
    return params


def partial_rotary_factor(raw: Mapping[str, Any]) -> float:
    """The fraction of each head's features RoPE rotates (Phi-4-mini: 0.75)."""
    params = _rope_parameters(raw, FULL_ATTENTION)
    value = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)))
    if not 0 < value <= 1:
        raise ValueError(f"partial_rotary_factor must be in (0, 1], got {value}")
    return value


def local_rope_config(raw: Mapping[str, Any]) -> RopeConfig:
    """Gemma 3's RoPE of its sliding layers: the ``sliding_attention`` parameters
    (transformers 5) or plain RoPE of base ``rope_local_base_freq`` (older files)."""
    params = raw.get("rope_parameters") or {}
    if isinstance(params, Mapping) and SLIDING_ATTENTION in params:
        return rope_config(raw, SLIDING_ATTENTION)
    return RopeConfig(theta=float(raw.get("rope_local_base_freq", 10000.0)))


def rope_config(raw: Mapping[str, Any], layer_type: str = FULL_ATTENTION) -> RopeConfig:
    # transformers 5 writes ``rope_parameters`` (theta inside); older files write a
    # top-level ``rope_theta`` and an optional ``rope_scaling`` dict. Defaults are
    # resolved as transformers' ``standardize_rope_params`` and ``ROPE_INIT_FUNCTIONS`` do.
    params = _rope_parameters(raw, layer_type)
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(_unsupported_rope_message(rope_type))
    max_positions = int(raw.get("max_position_embeddings", 4096))
    original = params.get("original_max_position_embeddings")
    if rope_type in ("llama3", "yarn", "longrope"):
        # A top-level value (Phi-3 keeps it there) wins over the rope dict, as in HF.
        top_level = raw.get("original_max_position_embeddings")
        original = (top_level if top_level is not None else original) or max_positions
    original = None if original is None else int(original)
    factor = params.get("factor")
    if factor is None:
        if rope_type in ("yarn", "longrope"):
            factor = max_positions / original  # the context-extension ratio
        elif rope_type == "dynamic":
            raise ValueError(f"rope_type {rope_type!r} needs a 'factor'")
        else:
            factor = 1.0
    extra: dict[str, Any] = {}
    if rope_type == "yarn":
        extra = {
            "beta_fast": float(params.get("beta_fast") or 32.0),
            "beta_slow": float(params.get("beta_slow") or 1.0),
            "mscale": optional_float(params.get("mscale")),
            "mscale_all_dim": optional_float(params.get("mscale_all_dim")),
            "truncate": bool(params.get("truncate", True)),
        }
    if rope_type == "longrope":
        for name in ("short_factor", "long_factor"):
            values = params.get(name)
            if not isinstance(values, (list, tuple)) or not values:
                raise ValueError(f"longrope needs a list {name!r}, got {values!r}")
            extra[name] = tuple(float(v) for v in values)
    if rope_type in ("yarn", "longrope"):
        extra["attention_factor"] = optional_float(params.get("attention_factor"))
    return RopeConfig(
        theta=float(theta),
        rope_type=str(rope_type),
        factor=float(factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        **extra,
    )


def optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def checkpoint_dtype(raw: Mapping[str, Any]) -> str:
    value = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    value = str(value).removeprefix("torch.")
    aliases = {"bf16": "bfloat16", "fp32": "float32", "float": "float32", "half": "float16"}
    value = aliases.get(value, value)
    if value not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {value!r}; supported: {', '.join(SUPPORTED_DTYPES)}")
    return value


def eos_token_ids(raw: Mapping[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(int(x) for x in eos)


def activation(raw: Mapping[str, Any], supported: tuple[str, ...] = ("silu", "swish")) -> str:
    """The MLP activation (``hidden_act`` / ``hidden_activation``), checked."""
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    if act not in supported:
        raise ValueError(f"unsupported hidden_act {act!r}; this architecture supports "
                         f"{', '.join(supported)}")
    return "silu" if act == "swish" else str(act)


def head_dim(raw: Mapping[str, Any]) -> int:
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    if raw.get("head_dim"):
        return int(raw["head_dim"])
    if hidden % heads:
        raise ValueError(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}")
    return hidden // heads


def layer_types(raw: Mapping[str, Any], num_layers: int, pattern: int | None = None
                ) -> tuple[str, ...]:
    """Each layer's attention kind: the config's ``layer_types`` when present, else every
    ``pattern``-th layer full and the others sliding (Gemma's ``sliding_window_pattern``),
    else all full. Empty when every layer is full (the common case)."""
    types = raw.get("layer_types")
    if types is not None:
        if not isinstance(types, (list, tuple)) or len(types) != num_layers:
            raise ValueError(f"layer_types must list {num_layers} layers, got {types!r}")
        for kind in types:
            if kind not in LAYER_TYPES:
                raise ValueError(f"unsupported layer type {kind!r}; supported: "
                                 f"{', '.join(LAYER_TYPES)}")
        result = tuple(str(t) for t in types)
    elif pattern:
        result = tuple(
            FULL_ATTENTION if (i + 1) % pattern == 0 else SLIDING_ATTENTION
            for i in range(num_layers)
        )
    else:
        result = ()
    return () if all(t == FULL_ATTENTION for t in result) else result


def decoder_fields(raw: Mapping[str, Any]) -> dict[str, Any]:
    """:class:`~kvpage.model.config.ModelConfig` keyword arguments from the fields every
    decoder-only config spells the same way (not ``architecture``)."""
    hidden = int(raw["hidden_size"])
    heads = int(raw["num_attention_heads"])
    return {
        "vocab_size": int(raw["vocab_size"]),
        "hidden_size": hidden,
        "intermediate_size": int(raw["intermediate_size"]),
        "num_layers": int(raw["num_hidden_layers"]),
        "num_heads": heads,
        "num_kv_heads": int(raw.get("num_key_value_heads") or heads),
        "head_dim": head_dim(raw),
        "rms_norm_eps": float(raw.get("rms_norm_eps", 1e-6)),
        "rope": rope_config(raw),
        "max_position_embeddings": int(raw.get("max_position_embeddings", 4096)),
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "dtype": checkpoint_dtype(raw),
        "eos_token_ids": eos_token_ids(raw),
    }


def sliding_window(raw: Mapping[str, Any]) -> int | None:
    value = raw.get("sliding_window")
    return None if value is None else int(value)

