"""Getting a parameter pytree: from an HF directory, from random numbers, or from memory.

This file owns the three ways to obtain params for :mod:`kvpage.model.decoder`:

* :func:`load_model` / :func:`load_params` read an HF-format directory (``config.json``
  plus one ``*.safetensors`` file or a sharded set with ``model.safetensors.index.json``).
  Only safetensors are read, never pickled ``.bin`` files.
* :func:`random_params` builds weights at a config's real shapes for benchmarking.
* :func:`params_from_pytree` / :func:`params_from_hf_tensors` adopt weights that are
  already in memory (a JAX training run's pytree, or an HF-style flat state dict).

``dtype`` everywhere is ``"auto"`` (the checkpoint config's dtype), ``"float32"``,
``"bfloat16"`` or ``"float16"``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvpage.model.architectures import TensorSource, get_architecture
from kvpage.model.architectures.architecture import available_source
from kvpage.model.config import ModelConfig
from kvpage.model.errors import CheckpointError
from kvpage.model.params import (
    Params,
    cast_params,
    jnp_dtype,
    param_spec,
    tree_from_flat,
    validate_params,
)
from kvpage.model.safetensors_file import SafetensorsFile
from kvpage.quant.int8 import quantize_int8

logger = logging.getLogger(__name__)

_INDEX_FILE = "model.safetensors.index.json"
_SINGLE_FILE = "model.safetensors"


def resolve_dtype(config: ModelConfig, dtype: str) -> str:
    """``"auto"`` -> the config's dtype; otherwise validate and return ``dtype``."""
    if dtype == "auto":
        return config.dtype
    jnp_dtype(dtype)
    return dtype


def auto_dtype_for_platform(checkpoint_dtype: str, platform: str) -> str:
    """``dtype="auto"`` on ``platform``: the checkpoint's dtype, except that a
    float32 checkpoint runs in bfloat16 on an accelerator (as vLLM downcasts):
    float32 weights there use no tensor cores and the f32 attention kernels
    spill. On CPU the checkpoint's dtype stays."""
    if platform != "cpu" and checkpoint_dtype == "float32":
        return "bfloat16"
    return checkpoint_dtype


def load_model(
    model_dir: str | Path,
    dtype: str = "auto",
    device: jax.Device | None = None,
    quantization: str = "auto",
) -> tuple[ModelConfig, Params]:
    """Read ``config.json`` and the safetensors weights of an HF model directory.

    ``dtype="auto"`` is the checkpoint's dtype, but bfloat16 for a float32
    checkpoint on a GPU/TPU (``auto_dtype_for_platform``; logged); the returned
    config carries the dtype the weights have.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(f"model directory not found: {model_dir}")
    config = ModelConfig.from_pretrained(model_dir)
    if dtype == "auto":
        platform = device.platform if device is not None else jax.default_backend()
        dtype = auto_dtype_for_platform(config.dtype, platform)
        if dtype != config.dtype:
            logger.info("dtype=auto: the %s checkpoint runs in %s on %s (pass --dtype float32 "
                        "to keep float32)", config.dtype, dtype, platform)
    if dtype != config.dtype:
        jnp_dtype(dtype)
        config = dataclasses.replace(config, dtype=dtype)
    return config, load_params(
        model_dir, config, dtype=dtype, device=device, int8=quantization == "int8"
    )


def _weight_files(model_dir: Path) -> dict[str, Path]:
    """Map each tensor name to the safetensors file that holds it (not yet opened)."""
    index_path = model_dir / _INDEX_FILE
    if index_path.is_file():
        try:
            index = json.loads(index_path.read_text(encoding="utf-8"))
            weight_map = index["weight_map"]
            if not isinstance(weight_map, dict):
                raise TypeError("weight_map is not an object")
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"malformed weight index {index_path}: {exc}") from exc
        root = model_dir.resolve()
        files = {str(name): (model_dir / str(file)) for name, file in weight_map.items()}
        for name, path in files.items():
            if not path.resolve().is_relative_to(root):
                raise CheckpointError(
                    f"weight index {index_path} points tensor {name!r} outside the model "
                    f"directory: {path}"
                )
        return files
    files = [model_dir / _SINGLE_FILE] if (model_dir / _SINGLE_FILE).is_file() else sorted(
        model_dir.glob("*.safetensors")
    )
    if not files:
        bins = sorted(p.name for p in model_dir.glob("*.bin"))
        hint = f" (found {', '.join(bins)}; pickle checkpoints are not loaded)" if bins else ""
        raise CheckpointError(f"no *.safetensors weight files in {model_dir}{hint}")
    mapping: dict[str, Path] = {}
    for path in files:
        for name in SafetensorsFile(path).keys():
            mapping[name] = path
    return mapping


def load_params(
    model_dir: str | Path,
    config: ModelConfig,
    dtype: str = "auto",
    device: jax.Device | None = None,
    int8: bool = False,
) -> Params:
    """Load every tensor of :func:`param_spec` from ``model_dir`` as ``dtype`` jax arrays
    (``int8``: 2-D weights as per-channel int8, quantized on the host as they are read).

    Tensors the model does not use (``lm_head.weight`` of a tied model, rotary buffers)
    are ignored; missing tensors and shape mismatches raise :class:`CheckpointError`.
    """
    model_dir = Path(model_dir)
    target = jnp_dtype(resolve_dtype(config, dtype))
    where = _weight_files(model_dir)
    arch = get_architecture(config.architecture)
    spec = param_spec(config)
    sources = {
        name: available_source(arch.source(name, config), where.__contains__) for name in spec
    }
    missing = [n for source in sources.values() for n in source.names if n not in where]
    if missing:
        more = f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""
        raise CheckpointError(
            f"checkpoint {model_dir} lacks tensors: {', '.join(missing[:8])}{more}"
        )
    files: dict[Path, SafetensorsFile] = {}

    def get(name: str) -> Any:
        path = where[name]
        if path not in files:
            files[path] = SafetensorsFile(path)
        shard = files[path]
        if name not in shard:
            raise CheckpointError(f"tensor {name!r} is listed for {path} but absent from it")
        return shard.get(name)

    flat: dict[str, Any] = {}
    for name, shape in spec.items():
        source = sources[name]
        host = source.read(get)
        if host.shape != shape:
            raise CheckpointError(
                f"tensor {name!r} (from {', '.join(source.names[:2])}) in {model_dir} has "
                f"shape {host.shape}, expected {shape}"
            )
        if int8 and len(shape) == 2:
            flat[name] = jax.device_put(quantize_int8(host, target), device)
            continue
        # Convert on the device: the host only streams the file's bytes.
        value = jax.device_put(host, device)
        flat[name] = value if value.dtype == target else value.astype(target)
    return tree_from_flat(config, flat)


def params_from_hf_tensors(
    config: ModelConfig,
    tensors: Mapping[str, Any],
    dtype: str = "auto",
    device: jax.Device | None = None,
) -> Params:
    """Adopt an in-memory HF-named flat mapping (e.g. a converted ``state_dict``), in
    the checkpoint spelling of ``config``'s architecture (per-expert tensors, fused
    projections) or already in kvpage's names."""
    arch = get_architecture(config.architecture)
    flat = {}
    for name, shape in param_spec(config).items():
        source = (
            TensorSource((name,)) if name in tensors
            else available_source(arch.source(name, config), tensors.__contains__)
        )
        absent = [n for n in source.names if n not in tensors]
        if absent:
            raise CheckpointError(f"tensors missing from mapping: {', '.join(absent[:8])}")
        plain = not (source.stacked or source.rows or source.transform or source.combine)
        value = tensors[source.names[0]] if plain else source.read(tensors.__getitem__)
        if tuple(np.shape(value)) != shape:
            raise CheckpointError(
                f"tensor {name!r} has shape {tuple(np.shape(value))}, expected {shape}"
            )
        flat[name] = value
    return cast_params(tree_from_flat(config, flat), resolve_dtype(config, dtype), device)


def params_from_pytree(
    config: ModelConfig,
    params: Params,
    dtype: str | None = None,
    device: jax.Device | None = None,
) -> Params:
    """Validate a pytree in the :mod:`kvpage.model.params` layout and move it to ``device``.

    ``dtype=None`` keeps each leaf's dtype; ``"auto"`` uses the config's.
    """
    validate_params(config, params)
    target = None if dtype is None else resolve_dtype(config, dtype)
    return cast_params(params, target, device)


def random_params(
    config: ModelConfig,
    seed: int = 0,
    dtype: str = "auto",
    device: jax.Device | None = None,
    scale: float = 0.02,
) -> Params:
    """Normal(0, ``scale``) weights (norms scaling by 1, biases 0) at the config's real
    shapes.

    Generated on the device tensor by tensor, so an 8B model needs no host memory.
    """
    target = jnp_dtype(resolve_dtype(config, dtype))
    base = jax.random.key(seed)
    flat: dict[str, jax.Array] = {}
    for index, (name, shape) in enumerate(param_spec(config).items()):
        if name.endswith("norm.weight"):  # scale 1 (Gemma scales by 1 + weight)
            value = jnp.full(shape, 1.0 - config.norm_offset, target, device=device)
        elif name.endswith(".bias"):
            value = jnp.zeros(shape, target, device=device)
        else:
            value = _normal(jax.random.fold_in(base, index), shape, target, scale, device)
        flat[name] = value
    return tree_from_flat(config, flat)


def _normal(
    key: jax.Array, shape: tuple[int, ...], dtype: Any, scale: float, device: jax.Device | None
) -> jax.Array:
    if device is not None:
        key = jax.device_put(key, device)
    return _normal_jit(key, shape, dtype, scale)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _normal_jit(key: jax.Array, shape: tuple[int, ...], dtype: Any, scale: float) -> jax.Array:
    return (jax.random.normal(key, shape, jnp.float32) * scale).astype(dtype)
