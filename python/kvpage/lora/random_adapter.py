"""Random PEFT-format LoRA adapters, for tests and benchmarks: :func:`write_random_adapter`
writes what PEFT's ``save_pretrained`` would (``adapter_config.json``,
``adapter_model.safetensors``) for a base model's projection shapes, and
:func:`merged_tensors` folds an adapter into the base weights (the reference a LoRA run
must equal)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from kvpage.lora.adapter import MODULES

_BLOCK = {m: "self_attn" for m in MODULES[:4]} | {m: "mlp" for m in MODULES[4:]}


def write_random_adapter(
    path: str | Path,
    shapes: dict[tuple[int, str], tuple[int, int]],
    rank: int = 8,
    alpha: float = 16.0,
    seed: int = 0,
    modules: tuple[str, ...] = MODULES,
    std: float = 0.05,
) -> Path:
    """A random adapter of ``rank`` on ``modules`` of every layer in ``shapes``
    (``(layer, module) -> (out, in)``); ``B`` is not zero (unlike a fresh PEFT
    adapter), so it changes the outputs."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tensors = {}
    for (layer, module), (out, inner) in sorted(shapes.items()):
        if module not in modules:
            continue
        prefix = f"base_model.model.model.layers.{layer}.{_BLOCK[module]}.{module}"
        tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, std, (rank, inner)).astype(np.float32)
        tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, std, (out, rank)).astype(np.float32)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": alpha,
              "target_modules": list(modules), "bias": "none", "use_rslora": False,
              "use_dora": False, "fan_in_fan_out": False}
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return path


def merged_tensors(base: dict[str, np.ndarray], adapter_dir: str | Path
                   ) -> dict[str, np.ndarray]:
    """HF-named base ``tensors`` with the adapter folded in: ``W + scale * B @ A``."""
    from kvpage.model.safetensors_file import SafetensorsFile

    adapter_dir = Path(adapter_dir)
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    scale = config["lora_alpha"] / config["r"]
    tensors = SafetensorsFile(adapter_dir / "adapter_model.safetensors")
    merged = dict(base)
    for key in tensors.keys():
        if ".lora_A." not in key:
            continue
        name = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
        a, b = tensors.get(key), tensors.get(key.replace(".lora_A.", ".lora_B."))
        merged[name] = (base[name].astype(np.float64)
                        + scale * (b.astype(np.float64) @ a.astype(np.float64))
                        ).astype(base[name].dtype)
    return merged
