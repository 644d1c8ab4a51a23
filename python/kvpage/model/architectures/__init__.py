"""The architectures kvpage loads: one short declarative file per family.

Each file declares :class:`~.architecture.Architecture` values: the HF names, the
``config.json`` parsing into :class:`~kvpage.model.config.ModelConfig` fields, and how
its checkpoints spell kvpage's tensors. The forward pass is shared
(:mod:`kvpage.model.decoder`, assembled from the config's fields), so adding an
architecture is adding a file here and a line to :data:`REGISTRY`.

Dependencies point down: this package imports :mod:`kvpage.model.hf_config` and
:mod:`kvpage.model.config_types`; :mod:`kvpage.model.config` imports this registry.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvpage.model.architectures.architecture import Architecture, TensorSource
from kvpage.model.architectures.gemma import GEMMA, GEMMA2, GEMMA3
from kvpage.model.architectures.gpt_oss import GPT_OSS
from kvpage.model.architectures.llama import LLAMA, MISTRAL, QWEN2, QWEN3
from kvpage.model.architectures.moe import MIXTRAL, OLMOE, QWEN2_MOE, QWEN3_MOE
from kvpage.model.architectures.phi3 import PHI3

REGISTRY: dict[str, Architecture] = {
    arch.name: arch
    for arch in (
        LLAMA, MISTRAL, QWEN2, QWEN3, QWEN3_MOE, QWEN2_MOE, MIXTRAL, OLMOE, GEMMA, GEMMA2,
        GEMMA3, PHI3, GPT_OSS,
    )
}
SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(REGISTRY)
_BY_MODEL_TYPE = {arch.model_type: arch for arch in REGISTRY.values()}
SUPPORTED_GGUF_ARCHITECTURES: tuple[str, ...] = tuple(dict.fromkeys(
    name for arch in REGISTRY.values() for name in arch.gguf_names
))


def unknown_architecture_message(name: str) -> str:
    return (
        f"unsupported architecture {name!r}; "
        f"supported architectures: {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def get_architecture(name: str) -> Architecture:
    """The registered architecture ``name``; ValueError naming the supported ones."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(unknown_architecture_message(name)) from None


def architecture_of(raw: Mapping[str, Any]) -> Architecture:
    """The architecture an HF ``config.json`` describes (``architectures``, else
    ``model_type``); ValueError naming it when kvpage does not support it."""
    archs = raw.get("architectures")
    if archs:
        if isinstance(archs, str):
            archs = [archs]
        for arch in archs:
            if arch in REGISTRY:
                return REGISTRY[arch]
        raise ValueError(unknown_architecture_message(", ".join(map(str, archs))))
    model_type = raw.get("model_type")
    if model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    raise ValueError(unknown_architecture_message(f"<model_type {model_type!r}>"))


def gguf_architecture(name: str, experts: int = 0) -> Architecture | None:
    """The architecture of a GGUF ``general.architecture`` value (with ``experts`` > 0
    the experts-carrying variant, e.g. Mixtral for ``llama``), or None."""
    matches = [arch for arch in REGISTRY.values() if name in arch.gguf_names]
    for arch in matches:
        if arch.gguf_experts == (experts > 0):
            return arch
    return matches[0] if matches else None


__all__ = [
    "REGISTRY",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_GGUF_ARCHITECTURES",
    "Architecture",
    "TensorSource",
    "architecture_of",
    "get_architecture",
    "gguf_architecture",
]
