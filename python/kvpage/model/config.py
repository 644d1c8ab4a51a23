"""Model configuration: the decoder hyper-parameters kvpage needs, parsed from HF ``config.json``.

This file owns :class:`ModelConfig`: one normalised, hashable description of a model
(frozen, so it can be a static argument of ``jax.jit``). Its fields say which shared
blocks the decoder (:mod:`kvpage.model.decoder`) assembles: norm offset, sandwich norms,
MLP activation, mixture-of-experts, each layer's attention kind, soft-caps, partial
RoPE. The per-architecture translation from the Hugging Face dialects lives in
:mod:`kvpage.model.architectures` (one file per family); :class:`RopeConfig` and
:class:`MoEConfig` in :mod:`kvpage.model.config_types`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvpage.model.architectures import (
    REGISTRY,
    SUPPORTED_ARCHITECTURES,
    architecture_of,
    unknown_architecture_message,
)
from kvpage.model.config_types import (
    FULL_ATTENTION,
    LAYER_TYPES,
    SLIDING_ATTENTION,
    SUPPORTED_DTYPES,
    SUPPORTED_ROPE_TYPES,
    MoEConfig,
    RopeConfig,
)
from kvpage.model.errors import CheckpointError

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
    ``h // (num_heads // num_kv_heads)``. The defaults are the Llama layout; the other
    fields switch shared blocks on (see :mod:`kvpage.model.decoder`):

    * ``layer_types``: each layer's attention kind (:data:`FULL_ATTENTION` or
      :data:`SLIDING_ATTENTION`, attending the last ``sliding_window`` positions); empty
      means every layer is full. ``rope_local``: the RoPE of sliding layers, when it
      differs (Gemma 3).
    * ``qk_norm``: RMS-normalise queries and keys, per head (``qk_norm_over="head"``,
      Qwen3, Gemma 3) or over the whole projection (``"projection"``, OLMoE).
    * ``norm_offset``: RMSNorm scales by ``norm_offset + weight`` (Gemma: 1).
      ``sandwich_norms``: norms after attention and MLP too, and a separate norm before
      the MLP (Gemma 2/3).
    * ``hidden_act``: ``"silu"`` (SwiGLU) or ``"gelu_tanh"`` (GeGLU).
    * ``embedding_multiplier``: input embeddings are multiplied by it (Gemma).
    * ``query_scale``: the attention score scale (default ``head_dim ** -0.5``).
    * ``attn_logit_softcap`` / ``final_logit_softcap``: ``cap * tanh(x / cap)`` of the
      attention scores / the output logits (Gemma 2).
    * ``partial_rotary_factor``: RoPE rotates the first ``rotary_dim`` features only.
    * ``moe``: the feed-forward block is a routed mixture of experts.
    * ``attention_sinks``: one learned logit per query head joins each softmax's
      denominator (gpt-oss; ``self_attn.sinks``).
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
    layer_types: tuple[str, ...] = ()
    rope_local: RopeConfig | None = None
    qk_norm_over: str = "head"
    norm_offset: float = 0.0
    sandwich_norms: bool = False
    hidden_act: str = "silu"
    embedding_multiplier: float | None = None
    query_scale: float | None = None
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    partial_rotary_factor: float = 1.0
    moe: MoEConfig | None = None
    attention_sinks: bool = False

    def __post_init__(self) -> None:
        if self.architecture not in REGISTRY:
            raise ValueError(unknown_architecture_message(self.architecture))
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
        if self.rotary_dim % 2 or self.rotary_dim <= 0:
            raise ValueError(f"partial_rotary_factor {self.partial_rotary_factor} gives an "
                             f"odd or empty rotary dimension {self.rotary_dim}")
        _check_rope(self.rope, self.rotary_dim)
        if self.rope_local is not None:
            _check_rope(self.rope_local, self.rotary_dim)
        if self.dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"unsupported dtype {self.dtype!r}; supported: {', '.join(SUPPORTED_DTYPES)}"
            )
        self._check_layers()

    def _check_layers(self) -> None:
        if self.layer_types:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types lists {len(self.layer_types)} layers, the "
                                 f"model has {self.num_layers}")
            unknown = set(self.layer_types) - set(LAYER_TYPES)
            if unknown:
                raise ValueError(f"unknown layer types {sorted(unknown)}; known: "
                                 f"{', '.join(LAYER_TYPES)}")
            if SLIDING_ATTENTION in self.layer_types and not self.sliding_window:
                raise ValueError("sliding-attention layers need a sliding_window")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive, got {self.sliding_window}")
        if self.qk_norm_over not in ("head", "projection"):
            raise ValueError(f"qk_norm_over must be 'head' or 'projection', got "
                             f"{self.qk_norm_over!r}")
        if self.hidden_act not in ("silu", "gelu_tanh"):
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; supported: "
                             "silu, gelu_tanh")
        if self.moe is not None:
            bad = [i for i in self.moe.dense_layers if not 0 <= i < self.num_layers]
            if bad:
                raise ValueError(f"MoE dense_layers {bad} are not layers of the model")

    @property
    def model_type(self) -> str:
        return REGISTRY[self.architecture].model_type

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def rotary_dim(self) -> int:
        """Features of each head RoPE rotates (the first ones)."""
        return int(self.head_dim * self.partial_rotary_factor)

    def layer_type(self, index: int) -> str:
        """Layer ``index``'s attention kind."""
        return self.layer_types[index] if self.layer_types else FULL_ATTENTION

    def is_moe_layer(self, index: int) -> bool:
        """Whether layer ``index``'s feed-forward block is the mixture of experts."""
        return self.moe is not None and index not in self.moe.dense_layers

    @property
    def all_layers_slide(self) -> bool:
        """Whether every layer attends only the last ``sliding_window`` positions (then
        KV blocks that leave the window are never read again)."""
        return bool(self.layer_types) and all(
            t == SLIDING_ATTENTION for t in self.layer_types
        )

    def with_overrides(self, **changes: Any) -> ModelConfig:
        """A copy with some fields replaced (e.g. ``num_layers=2`` for a quick benchmark)."""
        if "num_layers" in changes and self.layer_types and "layer_types" not in changes:
            n = changes["num_layers"]
            changes["layer_types"] = tuple(
                self.layer_types[i % len(self.layer_types)] for i in range(n)
            )
        return replace(self, **changes)

    @classmethod
    def from_hf_dict(cls, raw: Mapping[str, Any]) -> ModelConfig:
        """Parse the contents of an HF ``config.json`` (any transformers 4.x / 5.x dialect)."""
        arch = architecture_of(raw)
        return cls(architecture=arch.name, **arch.parse(raw))

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
            return cls.from_hf_dict(raw)
        except KeyError as exc:
            raise CheckpointError(f"invalid model config {path}: missing field {exc}") from exc
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"invalid model config {path}: {exc}") from exc

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> ModelConfig:
        """Parse ``<model_dir>/config.json``."""
        return cls.from_json_file(Path(model_dir) / "config.json")


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


__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_DTYPES",
    "SUPPORTED_ROPE_TYPES",
    "ModelConfig",
    "MoEConfig",
    "RopeConfig",
]
