"""A LoRA adapter's weights, and the loader of PEFT-format directories.

Owns :class:`LoRAAdapter`: for each adapted projection ``(layer, module)`` the pair
``A [r, in]``, ``B [out, r]`` with the adapter's scale already folded into ``B`` (PEFT:
``lora_alpha / r``, or ``lora_alpha / sqrt(r)`` with ``use_rslora``), so that a row's
output is ``W x + B (A x)``. :func:`load_peft_adapter` reads ``adapter_config.json`` and
``adapter_model.safetensors`` as PEFT's ``save_pretrained`` writes them.

Invariants: every pair's shapes agree with the base model's projection (checked at load,
naming the tensor); modules are those kvpage applies adapters to (:data:`MODULES`); an
adapter kvpage cannot apply exactly (DoRA, trained biases, extra saved modules, a
``fan_in_fan_out`` layout) is refused with the reason, never silently approximated.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
MODULES = ATTENTION_MODULES + MLP_MODULES
"""The projections an adapter may target (attention and the dense MLP)."""

_KEY = re.compile(
    r"(?:.*\.)?layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.\w+)?\.weight$"
)


@dataclass
class LoRAAdapter:
    """Per ``(layer, module)``: ``(A [r, in], B [out, r] * scale)`` as float32 numpy."""

    rank: int
    weights: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def _config(path: Path) -> dict[str, Any]:
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"LoRA adapter {path}: no adapter_config.json (a PEFT directory)")
    config = json.loads(config_file.read_text())
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {path}: peft_type {config['peft_type']!r} is not LORA")
    refused = {
        "use_dora": "DoRA adapters are not supported",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D-layout) adapters are not supported",
        "modules_to_save": "adapters that save whole modules (modules_to_save) are not "
                           "supported",
    }
    for key, reason in refused.items():
        if config.get(key):
            raise ValueError(f"LoRA adapter {path}: {reason}")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {path}: trained biases (bias={config['bias']!r}) "
                         "are not supported")
    return config


def _scale(config: dict[str, Any], key: str, rank: int) -> float:
    alpha = float(config.get("lora_alpha", rank))
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if key.endswith(pattern) or re.search(pattern, key):
            alpha = float(value)
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


def load_peft_adapter(
    path: str | Path,
    shapes: dict[tuple[int, str], tuple[int, int]],
    max_rank: int,
) -> LoRAAdapter:
    """Load a PEFT LoRA directory for a base model whose projection ``(layer, module)``
    has weight shape ``(out, in)`` in ``shapes``; ranks above ``max_rank`` are refused."""
    from kvpage.model.safetensors_file import SafetensorsFile

    path = Path(path)
    config = _config(path)
    tensors_file = path / "adapter_model.safetensors"
    if not tensors_file.is_file():
        raise ValueError(f"LoRA adapter {path}: no adapter_model.safetensors (pickled "
                         "adapter_model.bin files are not loaded)")
    tensors = SafetensorsFile(tensors_file)
    pairs: dict[tuple[int, str], dict[str, tuple[str, np.ndarray]]] = {}
    for key in tensors.keys():
        match = _KEY.match(key)
        if match is None:
            raise ValueError(f"LoRA adapter {path}: tensor {key!r} is not a LoRA A/B weight "
                             f"of a decoder layer's {', '.join(MODULES)}")
        layer, module, which = int(match[1]), match[2], match[3]
        if (layer, module) not in shapes:
            raise ValueError(f"LoRA adapter {path}: {key!r} targets {module} of layer "
                             f"{layer}, which the base model does not have"
                             + ("" if module in MODULES else f" (adaptable: {MODULES})"))
        pairs.setdefault((layer, module), {})[which] = (key, tensors.get(key))
    if not pairs:
        raise ValueError(f"LoRA adapter {path}: adapter_model.safetensors holds no weights")
    adapter = LoRAAdapter(rank=0)
    for (layer, module), pair in sorted(pairs.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path}: layer {layer} {module} has only "
                             f"lora_{''.join(pair)}")
        (key_a, a), (key_b, b) = pair["A"], pair["B"]
        out, inner = shapes[(layer, module)]
        rank = a.shape[0]
        if a.shape != (rank, inner) or b.shape != (out, rank):
            raise ValueError(
                f"LoRA adapter {path}: {key_a} is {a.shape} and {key_b} is {b.shape}; the "
                f"base projection is [{out}, {inner}], so they must be [r, {inner}] and "
                f"[{out}, r]"
            )
        if rank > max_rank:
            raise ValueError(f"LoRA adapter {path}: rank {rank} of {key_a} exceeds "
                             f"max_lora_rank={max_rank}")
        scale = _scale(config, key_a, rank)
        adapter.weights[(layer, module)] = (
            np.asarray(a, np.float32), np.asarray(b, np.float32) * np.float32(scale)
        )
        adapter.rank = max(adapter.rank, rank)
    return adapter
