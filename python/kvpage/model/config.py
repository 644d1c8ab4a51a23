"""Model configuration: the decoder hyper-parameters kvpage needs, parsed from HF ``config.json``.

This file owns :class:`ModelConfig` / :class:`RopeConfig` and the translation from the
Hugging Face configuration dialects (transformers 4 ``rope_theta`` + ``rope_scaling``,
transformers 5 ``rope_parameters``; ``torch_dtype`` or ``dtype``) into one normalised,
hashable description. The config is frozen so it can be a static argument of ``jax.jit``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvpage.model.errors import CheckpointError

# Architecture name -> (model_type, default q/k/v bias, per-head q/k RMSNorm).
_ARCHITECTURES: dict[str, tuple[str, bool, bool]] = {
    "LlamaForCausalLM": ("llama", False, False),
    "MistralForCausalLM": ("mistral", False, False),
    "Qwen2ForCausalLM": ("qwen2", True, False),
    "Qwen3ForCausalLM": ("qwen3", False, True),
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_ARCHITECTURES)
_MODEL_TYPE_TO_ARCH = {model_type: arch for arch, (model_type, _, _) in _ARCHITECTURES.items()}

SUPPORTED_ROPE_TYPES: tuple[str, ...] = (
    "default", "linear", "llama3", "yarn", "longrope", "dynamic"
)
SUPPORTED_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "float16")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding parameters (the math lives in :mod:`kvpage.model.rope`).

    ``rope_type`` is one of :data:`SUPPORTED_ROPE_TYPES`:

    * ``"default"``: plain RoPE of base ``theta``;
    * ``"linear"``: positions divided by ``factor``;
    * ``"llama3"``: Llama 3.1 frequency-dependent scaling (``factor``,
      ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``);
    * ``"yarn"``: YaRN (``factor``, ``original_max_position_embeddings``, ``beta_fast``,
      ``beta_slow``, ``truncate``) with the cos/sin attention scaling ``attention_factor``,
      or when that is None the one derived from ``factor``, ``mscale``, ``mscale_all_dim``;
    * ``"longrope"``: Phi-3 LongRoPE, per-frequency divisors ``short_factor`` /
      ``long_factor`` (tuples of ``head_dim / 2`` floats) switched at
      ``original_max_position_embeddings``, attention scaling ``attention_factor`` or
      derived from ``factor``;
    * ``"dynamic"``: dynamic NTK scaling by ``factor`` once a sequence exceeds the model's
      ``max_position_embeddings``.

    Parsed configs have every default already resolved the way transformers resolves it
    (``factor`` of yarn / longrope from the context ratio when absent,
    ``original_max_position_embeddings`` from ``max_position_embeddings``). Every field
    is hashable: the config is a ``jax.jit`` static argument.
    """

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # yarn and longrope: the cos/sin scale; None derives it from ``factor``
    attention_factor: float | None = None
    # longrope
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()


_SIZE_LIMITS = {
    # Far above any real model; a malformed config fails here instead of
    # building a parameter spec that exhausts memory.
    "vocab_size": 1 << 22,
    "hidden_size": 1 << 17,
    "intermediate_size": 1 << 19,
    "num_layers": 1 << 12,
    "num_heads": 1 << 12,
    "num_kv_heads": 1 << 12,
    "head_dim": 1 << 12,
}


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Everything the decoder, loader and KV cache need to know about a model.

    Attention projections hold ``num_heads * head_dim`` (queries) and
    ``num_kv_heads * head_dim`` (keys, values) features; query head ``h`` reads KV head
    ``h // (num_heads // num_kv_heads)``.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    dtype: str = "bfloat16"
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in _ARCHITECTURES:
            raise ValueError(_unknown_architecture_message(self.architecture))
        for name, upper in _SIZE_LIMITS.items():
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= upper:
                raise ValueError(f"{name} must be an int in [1, {upper}], got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads ({self.num_heads}) must be a multiple of "
                f"num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        _check_rope(self.rope, self.head_dim)
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"unsupported dtype {self.dtype!r}; supported: {', '.join(SUPPORTED_DTYPES)}"
            )

    @property
    def model_type(self) -> str:
        return _ARCHITECTURES[self.architecture][0]

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def with_overrides(self, **changes: Any) -> ModelConfig:
        """A copy with some fields replaced (e.g. ``num_layers=2`` for a quick benchmark)."""
        return replace(self, **changes)

    @classmethod
    def from_hf_dict(cls, raw: Mapping[str, Any]) -> ModelConfig:
        """Parse the contents of an HF ``config.json`` (any transformers 4.x / 5.x dialect)."""
        return _parse_hf_config(raw)

    @classmethod
    def from_json_file(cls, path: str | Path) -> ModelConfig:
        """Parse a ``config.json`` file; errors name the file."""
        path = Path(path)
        if not path.is_file():
            raise CheckpointError(f"model config not found: {path}")
        try:
            raw = json.loads(path.read_text(encoding="utf-8"))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise CheckpointError(f"malformed model config {path}: {exc}") from exc
        if not isinstance(raw, dict):
            raise CheckpointError(f"malformed model config {path}: top level is not an object")
        try:
            return _parse_hf_config(raw)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"invalid model config {path}: {exc}") from exc

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        """Parse ``<model_dir>/config.json``."""
        return cls.from_json_file(Path(model_dir) / "config.json")


def _unknown_architecture_message(name: str) -> str:
    return (
        f"unsupported architecture {name!r}; "
        f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def _architecture(raw: Mapping[str, Any]) -> str:
    archs = raw.get("architectures")
    if archs:
        if isinstance(archs, str):
            archs = [archs]
        for arch in archs:
            if arch in _ARCHITECTURES:
                return arch
        raise ValueError(_unknown_architecture_message(", ".join(map(str, archs))))
    model_type = raw.get("model_type")
    if model_type in _MODEL_TYPE_TO_ARCH:
        return _MODEL_TYPE_TO_ARCH[model_type]
    raise ValueError(_unknown_architecture_message(f"<model_type {model_type!r}>"))


def _unsupported_rope_message(rope_type: Any) -> str:
    return f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"


def _check_rope(rope: RopeConfig, head_dim: int) -> None:
    if rope.rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(_unsupported_rope_message(rope.rope_type))
    if rope.rope_type == "longrope":
        for name in ("short_factor", "long_factor"):
            values = getattr(rope, name)
            if len(values) != head_dim // 2:
                raise ValueError(
                    f"longrope {name} has {len(values)} values, expected head_dim / 2 = "
                    f"{head_dim // 2}"
                )
    if rope.rope_type in ("yarn", "dynamic", "linear") and not rope.factor > 0:
        raise ValueError(f"{rope.rope_type} rope factor must be positive, got {rope.factor}")


def _rope(raw: Mapping[str, Any]) -> RopeConfig:
    # transformers 5 writes ``rope_parameters`` (theta inside); older files write a
    # top-level ``rope_theta`` and an optional ``rope_scaling`` dict. Defaults are
    # resolved as transformers' ``standardize_rope_params`` and ``ROPE_INIT_FUNCTIONS`` do.
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"rope parameters must be an object, got {params!r}")
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
            "mscale": _optional_float(params.get("mscale")),
            "mscale_all_dim": _optional_float(params.get("mscale_all_dim")),
            "truncate": bool(params.get("truncate", True)),
        }
    if rope_type == "longrope":
        for name in ("short_factor", "long_factor"):
            values = params.get(name)
            if not isinstance(values, (list, tuple)) or not values:
                raise ValueError(f"longrope needs a list {name!r}, got {values!r}")
            extra[name] = tuple(float(v) for v in values)
    if rope_type in ("yarn", "longrope"):
        extra["attention_factor"] = _optional_float(params.get("attention_factor"))
    return RopeConfig(
        theta=float(theta),
        rope_type=str(rope_type),
        factor=float(factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        **extra,
    )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


def _dtype(raw: Mapping[str, Any]) -> str:
    value = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    value = str(value).removeprefix("torch.")
    aliases = {"bf16": "bfloat16", "fp32": "float32", "float": "float32", "half": "float16"}
    value = aliases.get(value, value)
    if value not in SUPPORTED_DTYPES:
        raise ValueError(f"unsupported dtype {value!r}; supported: {', '.join(SUPPORTED_DTYPES)}")
    return value


def _eos_ids(raw: Mapping[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    if isinstance(eos, int):
        return (eos,)
    return tuple(int(x) for x in eos)


def _parse_hf_config(raw: Mapping[str, Any]) -> ModelConfig:
    arch = _architecture(raw)
    model_type, default_qkv_bias, qk_norm = _ARCHITECTURES[arch]
    act = raw.get("hidden_act", raw.get("hidden_activation", "silu"))
    if act not in ("silu", "swish"):
        raise ValueError(f"unsupported hidden_act {act!r} (only silu/SwiGLU is implemented)")

    hidden = int(raw["hidden_size"])
    heads = int(raw["num_attention_heads"])
    kv_heads = int(raw.get("num_key_value_heads") or heads)
    head_dim = raw.get("head_dim")
    head_dim = int(head_dim) if head_dim else hidden // heads
    if not raw.get("head_dim") and hidden % heads:
        raise ValueError(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}")

    attention_bias = bool(raw.get("attention_bias", False))
    if model_type == "qwen2":
        qkv_bias, o_bias = True, False
    else:
        qkv_bias, o_bias = attention_bias or default_qkv_bias, attention_bias

    sliding = raw.get("sliding_window")
    if model_type == "qwen2" or model_type == "qwen3":
        sliding = sliding if raw.get("use_sliding_window", False) else None
    if model_type == "llama":
        sliding = None

    return ModelConfig(
        architecture=arch,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=_rope(raw),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_proj_bias=o_bias,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        qk_norm=qk_norm,
        sliding_window=None if sliding is None else int(sliding),
        dtype=_dtype(raw),
        eos_token_ids=_eos_ids(raw),
    )
