"""Reading a GGUF file (llama.cpp's format) into kvpage's config and params.

This file owns the mapping from GGUF to kvpage's model: :func:`read_gguf_config` turns
the file's metadata into a :class:`ModelConfig`, :func:`load_gguf` also reads every
tensor (container: :mod:`kvpage.model.gguf_file`; typed metadata:
:mod:`kvpage.model.gguf_metadata`; values: ``gguf.quants.dequantize``) into the
:mod:`kvpage.model.params` pytree under HF names, with the tokenizer
(:mod:`kvpage.model.gguf_tokenizer`) when asked.

Supported: ``general.architecture`` ``llama`` (also Mistral and SmolLM files, which
llama.cpp writes as llama), ``qwen2`` and ``qwen3``; tensor types F32, F16, BF16,
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K. Anything else, a file that
is not GGUF, or a truncated one raises :class:`CheckpointError` naming the problem.

Invariants on top of the container's (:mod:`kvpage.model.gguf_file`): every metadata
value is type-checked where it is read (:mod:`kvpage.model.gguf_metadata`); every
tensor a layer needs is present with the shape the config implies, or a
:class:`CheckpointError` names it.

llama.cpp's converter permutes the rows of Llama's q/k projections (per head, from HF's
"rotate half" pairing to interleaved pairs); :func:`_unpermute_rope_rows` undoes that,
as transformers' GGUF loader does (on a quantized tensor it moves whole rows of blocks).

``quantization`` (:mod:`kvpage.quant.modes`) decides what stays quantized: by default a
Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q6_K tensor stays in its blocks on CPU
(:class:`~kvpage.quant.QuantizedWeight`, no float copy); every other tensor, and every
tensor with ``quantization="none"``, is dequantized once at load: with ``dtype="auto"``
to float32 on CPU and bfloat16 on accelerators. ``"int8"`` requantizes the 2-D weights
per channel.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from kvpage.model.architectures import (
    SUPPORTED_GGUF_ARCHITECTURES,
    Architecture,
    gguf_architecture,
)
from kvpage.model.config import ModelConfig, RopeConfig
from kvpage.model.errors import CheckpointError
from kvpage.model.gguf_metadata import (
    field,
    float_field,
    int_field,
    open_gguf,
    required_int,
    tensor_shape,
)
from kvpage.model.gguf_tokenizer import tokenizer_of
from kvpage.model.params import Params, jnp_dtype, param_spec, tree_from_flat
from kvpage.model.rope import attention_scaling, inverse_frequencies
from kvpage.quant.int8 import quantize_int8
from kvpage.quant.modes import GGUF_KEPT, check_mode, keeps_gguf_blocks
from kvpage.quant.weights import QuantizedWeight

# The tensor types gguf.quants dequantizes that this loader accepts (names of
# gguf.GGMLQuantizationType members).
SUPPORTED_TENSOR_TYPES: tuple[str, ...] = (
    "F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0",
    "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K",
)

_TOP_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_ROPE_FREQS = "rope_freqs.weight"
# Llama 3.1's rope_scaling, which llama.cpp bakes into ``rope_freqs.weight``.
_LLAMA3_LOW_FREQ, _LLAMA3_HIGH_FREQ, _LLAMA3_ORIGINAL_CONTEXT = 1.0, 4.0, 8192

logger = logging.getLogger(__name__)


def _architecture(reader: Any, path: Path) -> tuple[str, Architecture]:
    """The file's ``general.architecture`` and the kvpage architecture it is."""
    name = field(reader, "general.architecture")
    experts = int_field(reader, f"{name}.expert_count", path, 0) if isinstance(name, str) else 0
    arch = gguf_architecture(name, experts or 0) if isinstance(name, str) else None
    if arch is None:
        raise CheckpointError(
            f"GGUF file {path} has architecture {name!r}; supported: "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    return str(name), arch


def _rope(reader: Any, arch: str, head_dim: int, context: int, path: Path) -> RopeConfig:
    theta = float_field(reader, f"{arch}.rope.freq_base", path, 10000.0)
    if theta <= 0:
        raise CheckpointError(f"GGUF file {path}: metadata '{arch}.rope.freq_base' is "
                              f"{theta}, not positive")
    scaling = field(reader, f"{arch}.rope.scaling.type", "none")
    factor = float_field(reader, f"{arch}.rope.scaling.factor", path, 1.0) or 1.0
    freqs = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    if freqs is not None:
        return _llama3_rope(reader, arch, freqs, theta, head_dim, context, path)
    if scaling in ("none", "") or (scaling == "linear" and factor == 1.0):
        return RopeConfig(theta=theta)
    if scaling == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=factor)
    if scaling == "yarn":
        return _yarn_rope(reader, arch, theta, factor, context, path)
    raise CheckpointError(
        f"GGUF file {path} uses rope scaling {scaling!r}; supported: none, linear, yarn, "
        "and Llama 3 frequency factors (rope_freqs.weight)"
    )


def _yarn_rope(
    reader: Any, arch: str, theta: float, factor: float, context: int, path: Path
) -> RopeConfig:
    """YaRN from the keys llama.cpp's ``convert_hf_to_gguf.py`` writes: ``factor``,
    ``original_context_length``, ``yarn_beta_fast`` / ``yarn_beta_slow`` and
    ``yarn_attn_factor`` (HF's ``attention_factor``) when the HF config had them,
    ``yarn_log_multiplier`` (HF's ``mscale_all_dim``, with ``mscale`` 1 as llama.cpp
    assumes). llama.cpp always truncates the correction range (transformers'
    ``truncate=True``); ``rope.scaling.attn_factor`` multiplies the attention scaling."""
    key = f"{arch}.rope.scaling."
    ext_factor = float_field(reader, key + "yarn_ext_factor", path, 1.0)
    if ext_factor != 1.0:
        raise CheckpointError(
            f"GGUF file {path}: metadata {key + 'yarn_ext_factor'!r} is {ext_factor}; only "
            "1.0 (transformers' YaRN) is supported"
        )
    log_mul = float_field(reader, key + "yarn_log_multiplier", path, 0.0)
    attn = field(reader, key + "yarn_attn_factor")
    rope = RopeConfig(
        theta=theta,
        rope_type="yarn",
        factor=factor,
        original_max_position_embeddings=(
            int_field(reader, key + "original_context_length", path, 0) or context
        ),
        beta_fast=float_field(reader, key + "yarn_beta_fast", path, 32.0) or 32.0,
        beta_slow=float_field(reader, key + "yarn_beta_slow", path, 1.0) or 1.0,
        mscale=1.0 if log_mul else None,
        mscale_all_dim=log_mul or None,
        attention_factor=(
            None if attn is None else float_field(reader, key + "yarn_attn_factor", path, 1.0)
        ),
    )
    extra = float_field(reader, key + "attn_factor", path, 1.0)
    if extra != 1.0:
        rope = dataclasses.replace(rope, attention_factor=attention_scaling(rope, context) * extra)
    return rope


def _llama3_rope(
    reader: Any, arch: str, tensor: Any, theta: float, head_dim: int, context: int, path: Path
) -> RopeConfig:
    """Recover Llama 3.1's rope_scaling from the per-frequency divisors llama.cpp stores,
    and check that it reproduces them exactly."""
    divisors = _dequantize(tensor, path).reshape(-1).astype(np.float64)
    if divisors.shape != (head_dim // 2,):
        raise CheckpointError(
            f"tensor {_ROPE_FREQS!r} in {path} has {divisors.size} values, "
            f"expected head_dim / 2 = {head_dim // 2}"
        )
    original = (
        int_field(reader, f"{arch}.rope.scaling.original_context_length", path, 0)
        or _LLAMA3_ORIGINAL_CONTEXT
    )
    rope = RopeConfig(
        theta=theta,
        rope_type="llama3",
        factor=float(divisors.max()),
        low_freq_factor=_LLAMA3_LOW_FREQ,
        high_freq_factor=_LLAMA3_HIGH_FREQ,
        original_max_position_embeddings=original,
    )
    plain = inverse_frequencies(head_dim, RopeConfig(theta=theta), context)
    scaled = inverse_frequencies(head_dim, rope, context)
    if not np.allclose(plain / divisors, scaled, rtol=1e-4, atol=0):
        raise CheckpointError(
            f"tensor {_ROPE_FREQS!r} in {path} is not Llama 3 rope scaling "
            f"(low_freq_factor {_LLAMA3_LOW_FREQ}, high_freq_factor {_LLAMA3_HIGH_FREQ}, "
            f"original context {original}); other per-frequency factors are not supported"
        )
    return rope


def _auto_dtype(reader: Any, device: jax.Device | None) -> str:
    """float32 on CPU; elsewhere the file's float type, bfloat16 for quantized or
    float32 weights (float32 uses no tensor cores; logged)."""
    platform = device.platform if device is not None else jax.default_backend()
    if platform == "cpu":
        return "float32"
    kinds = {t.tensor_type.name for t in reader.tensors if len(t.shape) > 1}
    if kinds == {"F32"}:
        logger.info("dtype=auto: the float32 GGUF weights run in bfloat16 on %s (pass "
                    "--dtype float32 to keep float32)", platform)
        return "bfloat16"
    if kinds == {"F16"}:
        return "float16"
    return "bfloat16"


def _config_from_reader(reader: Any, path: Path, dtype: str, device: jax.Device | None
                        ) -> ModelConfig:
    gguf_arch, arch = _architecture(reader, path)
    shapes = {t.name: tensor_shape(t) for t in reader.tensors}
    if "token_embd.weight" not in shapes:
        raise CheckpointError(f"GGUF file {path} lacks the tensor 'token_embd.weight'")
    if len(shapes["token_embd.weight"]) != 2:
        raise CheckpointError(f"GGUF file {path}: tensor 'token_embd.weight' has shape "
                              f"{shapes['token_embd.weight']}, not [vocab, hidden]")
    vocab, hidden = shapes["token_embd.weight"]
    heads = required_int(reader, f"{gguf_arch}.attention.head_count", path)
    if heads <= 0:
        raise CheckpointError(f"GGUF file {path} has {heads} attention heads")
    kv_heads = int_field(reader, f"{gguf_arch}.attention.head_count_kv", path, heads)
    head_dim = (int_field(reader, f"{gguf_arch}.attention.key_length", path, 0)
                or hidden // heads)
    rotary = int_field(reader, f"{gguf_arch}.rope.dimension_count", path, head_dim)
    if not 0 < rotary <= head_dim:
        raise CheckpointError(f"GGUF file {path} rotates {rotary} of {head_dim} head features")
    context = required_int(reader, f"{gguf_arch}.context_length", path)
    eos = [
        field(reader, f"tokenizer.ggml.{key}")
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
    ]
    if dtype == "auto":
        dtype = _auto_dtype(reader, device)
    jnp_dtype(dtype)
    q_norm = shapes.get("blk.0.attn_q_norm.weight")
    expert_width = int_field(reader, f"{gguf_arch}.expert_feed_forward_length", path, 0)
    try:
        fields: dict[str, Any] = dict(
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int_field(
                reader, f"{gguf_arch}.feed_forward_length", path, expert_width or None
            ) or required_int(reader, f"{gguf_arch}.feed_forward_length", path),
            num_layers=required_int(reader, f"{gguf_arch}.block_count", path),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=float_field(
                reader, f"{gguf_arch}.attention.layer_norm_rms_epsilon", path, 1e-6
            ),
            rope=_rope(reader, gguf_arch, rotary, context, path),
            partial_rotary_factor=rotary / head_dim,
            max_position_embeddings=context,
            tie_word_embeddings="output.weight" not in shapes,
            qkv_bias="blk.0.attn_q.bias" in shapes,
            o_proj_bias="blk.0.attn_output.bias" in shapes,
            mlp_bias="blk.0.ffn_gate.bias" in shapes,
            qk_norm=q_norm is not None,
            qk_norm_over="head" if q_norm in (None, (head_dim,)) else "projection",
            dtype=dtype,
            eos_token_ids=tuple(sorted({
                int(e) for e in eos if isinstance(e, int) and not isinstance(e, bool)
            })),
        )
        if arch.gguf_parse is not None:
            def get(suffix: str, default: Any) -> Any:
                return field(reader, f"{gguf_arch}.{suffix}", default)

            fields.update(arch.gguf_parse(get, fields))
        return ModelConfig(architecture=arch.name, **fields)
    except CheckpointError:
        raise
    except ValueError as exc:
        raise CheckpointError(f"GGUF file {path} describes an invalid model: {exc}") from None


def read_gguf_config(
    path: str | Path, dtype: str = "auto", device: jax.Device | None = None
) -> ModelConfig:
    """The :class:`ModelConfig` a GGUF file describes (reads metadata only).

    ``dtype="auto"`` is float32 on CPU; elsewhere the file's float type, and bfloat16
    for quantized weights. EOS ids are the file's eos / eot / eom token ids.
    """
    path = Path(path)
    return _config_from_reader(open_gguf(path), path, dtype, device)


def _dequantize(tensor: Any, path: Path) -> np.ndarray:
    """float32 values of one tensor, in the HF/numpy shape."""
    from gguf.quants import dequantize

    kind = tensor.tensor_type.name
    if kind not in SUPPORTED_TENSOR_TYPES:
        raise CheckpointError(
            f"tensor {tensor.name!r} in {path} has type {kind}, which kvpage does not "
            f"load; supported: {', '.join(SUPPORTED_TENSOR_TYPES)}"
        )
    values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
    return values.reshape(tensor_shape(tensor))


def _unpermute_rope_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row permutation of a q/k weight or bias.

    The converter reshapes each head's rows to ``[2, head_dim/2]`` and transposes them
    to ``[head_dim/2, 2]``; this reshapes to ``[heads, head_dim/2, 2]`` and swaps back.
    """
    half = weight.shape[0] // heads // 2
    rows = weight.reshape(heads, half, 2, *weight.shape[1:])
    return rows.swapaxes(1, 2).reshape(weight.shape)


Target = tuple[str, tuple[int, int] | None]
"""A kvpage tensor name a GGUF tensor fills, and the rows of it that fill it (fused)."""


def _hf_names(gguf_name: str, config: ModelConfig, arch: Architecture) -> list[Target]:
    """The kvpage tensors a GGUF tensor fills (empty if it is not a model weight)."""
    if gguf_name.count(".") == 1:
        stem, kind = gguf_name.split(".")
        if stem in _TOP_TENSORS and kind == "weight":
            return [(f"{_TOP_TENSORS[stem]}.{kind}", None)]
        return []
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match is None:
        return []
    layer, stem, kind = int(match.group(1)), match.group(2), match.group(3)
    if layer >= config.num_layers:
        return []
    prefix = f"model.layers.{layer}."
    if stem in arch.gguf_fused:
        return [(f"{prefix}{name}.{kind}", rows(config)) for name, rows in arch.gguf_fused[stem]]
    name = arch.gguf_tensors.get(stem) or _LAYER_TENSORS.get(stem)
    return [] if name is None else [(f"{prefix}{name}.{kind}", None)]


def _take_rows(value: np.ndarray | QuantizedWeight, rows: tuple[int, int] | None
               ) -> np.ndarray | QuantizedWeight:
    if rows is None:
        return value
    start, stop = rows
    if isinstance(value, QuantizedWeight):
        scales = None if value.row_scales is None else value.row_scales[start:stop]
        return QuantizedWeight(np.ascontiguousarray(value.blocks[start:stop]), value.kind,
                               (stop - start, value.shape[1]), value.dtype, scales)
    return value[start:stop]


def _squeezable(shape: tuple[int, ...], want: tuple[int, ...]) -> bool:
    """A vector stored for a ``[1, n]`` weight (the shared-expert gate)."""
    return math.prod(shape) == math.prod(want) and len(want) == 2 and 1 in want


class GGUFModel(NamedTuple):
    """What a GGUF file holds: the config, the dequantized params and the tokenizer
    (None if the file carries no vocabulary)."""

    config: ModelConfig
    params: Params
    tokenizer: Any


def load_gguf(
    path: str | Path,
    dtype: str = "auto",
    device: jax.Device | None = None,
    tokenizer: bool = True,
    progress: Callable[[int, int], None] | None = None,
    quantization: str = "auto",
    tensor_parallel_size: int = 1,
) -> GGUFModel:
    """Read a GGUF file into ``(config, params, tokenizer)``, keeping quantized tensors
    in their blocks or dequantizing them as ``quantization`` says (module docs; the
    devices the model will run on, ``device`` and ``tensor_parallel_size``, decide
    ``"auto"``).

    Every tensor of :func:`kvpage.model.params.param_spec` must be present with its
    exact shape; an unknown tensor, a missing one or an unsupported tensor type raises
    :class:`CheckpointError`. ``tokenizer=False`` skips building the tokenizer.
    ``progress(done, total)`` is called after each tensor.
    """
    path = Path(path)
    check_mode(quantization)
    reader = open_gguf(path)
    config = _config_from_reader(reader, path, dtype, device)
    platform = device.platform if device is not None else jax.default_backend()
    keep = keeps_gguf_blocks(quantization, platform, tensor_parallel_size)
    params = _params_from_reader(
        reader, path, config, device, progress, keep_blocks=keep, int8=quantization == "int8"
    )
    return GGUFModel(config, params, tokenizer_of(reader, path) if tokenizer else None)


def _params_from_reader(
    reader: Any,
    path: Path,
    config: ModelConfig,
    device: jax.Device | None,
    progress: Callable[[int, int], None] | None,
    keep_blocks: bool = False,
    int8: bool = False,
) -> Params:
    gguf_arch, arch = _architecture(reader, path)
    permuted = arch.gguf_qk_permuted
    target = jnp_dtype(config.dtype)
    spec = param_spec(config)
    flat: dict[str, Any] = {}
    tensors = [t for t in reader.tensors if t.name != _ROPE_FREQS]
    targets: list[list[Target]] = []
    for tensor in tensors:
        names = _hf_names(tensor.name, config, arch)
        if not names or any(name not in spec for name, _ in names):
            raise CheckpointError(
                f"GGUF file {path} holds tensor {tensor.name!r} of shape "
                f"{tensor_shape(tensor)}, which a {gguf_arch} model does not use"
            )
        shape = tensor_shape(tensor)
        for name, rows in names:
            want = spec[name]
            got = shape if rows is None else (rows[1] - rows[0], *shape[1:])
            if got != want and not (len(names) == 1 and _squeezable(shape, want)):
                raise CheckpointError(
                    f"tensor {tensor.name!r} ({name}) in {path} has shape {got}, "
                    f"expected {want}"
                )
        targets.append(names)

    def unpermuted(tensor: Any, values: np.ndarray) -> np.ndarray:
        if permuted and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
            heads = config.num_heads if ".attn_q." in tensor.name else config.num_kv_heads
            values = _unpermute_rope_rows(values, heads)
        return values

    def host_values(tensor: Any) -> np.ndarray | QuantizedWeight:
        shape = tensor_shape(tensor)
        kind = GGUF_KEPT.get(tensor.tensor_type.name)
        if keep_blocks and kind is not None and len(shape) in (2, 3):
            blocks = np.ascontiguousarray(unpermuted(tensor, tensor.data))
            return QuantizedWeight(blocks.reshape(*shape[:-1], -1), kind, shape, target)
        values = unpermuted(tensor, _dequantize(tensor, path))
        if config.norm_offset and tensor.name.endswith("norm.weight"):
            values = values - np.float32(config.norm_offset)  # stored with the offset added
        if int8 and values.ndim == 2:
            return quantize_int8(values, target)
        return values

    # numpy dequantizes outside the GIL: a few tensors at a time on every core, in order,
    # so at most ``window`` dequantized tensors wait for their transfer at once.
    workers = max(1, min(4, os.cpu_count() or 1))
    window = 2 * workers
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        pending: collections.deque[concurrent.futures.Future[Any]] = collections.deque()
        upcoming = iter(tensors)
        for done, names in enumerate(targets, start=1):
            while len(pending) < window and (tensor := next(upcoming, None)) is not None:
                pending.append(pool.submit(host_values, tensor))
            host = pending.popleft().result()
            for name, rows in names:
                part = _take_rows(host, rows)
                if not isinstance(part, QuantizedWeight) and part.shape != spec[name]:
                    part = part.reshape(spec[name])
                value = jax.device_put(part, device)
                if isinstance(value, QuantizedWeight) or value.dtype == target:
                    flat[name] = value
                else:
                    flat[name] = value.astype(target)
            if progress is not None:
                progress(done, len(tensors))
    missing = [name for name in spec if name not in flat]
    if missing:
        more = f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""
        raise CheckpointError(f"GGUF file {path} lacks tensors: {', '.join(missing[:8])}{more}")
    return tree_from_flat(config, flat)


