"""Reading a GGUF file (llama.cpp's format) into kvpage's config, params and tokenizer.

This file owns GGUF: :func:`read_gguf_config` turns the file's metadata into a
:class:`ModelConfig`, :func:`load_gguf` also dequantizes every tensor (header and index:
:mod:`kvpage.model.gguf_file`; values: ``gguf.quants.dequantize``) into the
:mod:`kvpage.model.params` pytree under HF names, and :func:`load_gguf_tokenizer` builds
the Hugging Face tokenizer (with the chat template) that the file's metadata describes.

Supported: ``general.architecture`` ``llama`` (also Mistral and SmolLM files, which
llama.cpp writes as llama), ``qwen2`` and ``qwen3``; tensor types F32, F16, BF16,
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K. Anything else, a file that
is not GGUF, or a truncated one raises :class:`CheckpointError` naming the problem.

Invariants on top of the container's (:mod:`kvpage.model.gguf_file`): every metadata
value is type-checked where it is read (a wrong type is a :class:`CheckpointError`
naming the key); the tokenizer's arrays are bounded before anything decodes them (at
most ``MAX_VOCAB`` tokens and no more than the embedding has rows, one score and one
token type per token, special token ids inside the vocabulary), and every failure to
build the tokenizer from them is a :class:`CheckpointError`.

llama.cpp's converter permutes the rows of Llama's q/k projections (per head, from HF's
"rotate half" pairing to interleaved pairs); :func:`_unpermute_rope_rows` undoes that,
as transformers' GGUF loader does (on a quantized tensor it moves whole rows of blocks).

``quantization`` (:mod:`kvpage.quant.modes`) decides what stays quantized: by default a
Q8_0 / Q4_0 / Q4_1 / Q4_K / Q6_K tensor stays in its blocks on CPU
(:class:`~kvpage.quant.QuantizedWeight`, no float copy); every other tensor, and every
tensor with ``quantization="none"``, is dequantized once at load: with ``dtype="auto"``
to float32 on CPU and bfloat16 on accelerators. ``"int8"`` requantizes the 2-D weights
per channel.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import math
import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np

from kvpage.model.config import ModelConfig, RopeConfig
from kvpage.model.errors import CheckpointError
from kvpage.model.gguf_file import GGUFArray, GGUFFile, value_type_name
from kvpage.model.params import Params, jnp_dtype, param_spec, tree_from_flat
from kvpage.model.rope import inverse_frequencies
from kvpage.quant.int8 import quantize_int8
from kvpage.quant.modes import GGUF_KEPT, check_mode, keeps_gguf_blocks
from kvpage.quant.weights import QuantizedWeight

GGUF_SUFFIX = ".gguf"
_MAGIC = b"GGUF"
# The most tokens (and merges, and elements of any tokenizer array) a file may declare:
# ModelConfig's bound on vocab_size. Decoding is bounded before it starts.
MAX_VOCAB = 1 << 22

# general.architecture -> (kvpage architecture, q/k rows permuted by llama.cpp).
_ARCHITECTURES: dict[str, tuple[str, bool]] = {
    "llama": ("LlamaForCausalLM", True),
    "qwen2": ("Qwen2ForCausalLM", False),
    "qwen3": ("Qwen3ForCausalLM", False),
}
SUPPORTED_GGUF_ARCHITECTURES: tuple[str, ...] = tuple(_ARCHITECTURES)

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


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` names a GGUF file (by its ``.gguf`` suffix or its magic bytes)."""
    path = Path(path)
    if path.is_dir():
        return False
    if path.suffix.lower() == GGUF_SUFFIX or not path.is_file():
        return path.suffix.lower() == GGUF_SUFFIX
    with path.open("rb") as f:
        return f.read(4) == _MAGIC


def _open(path: str | Path) -> GGUFFile:
    """The file's metadata and tensor index (:mod:`kvpage.model.gguf_file`, which checks
    the container: lengths, offsets, alignment, tensor bounds); every way the file can be
    unreadable is a :class:`CheckpointError` naming it."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file not found: {path}")
    with path.open("rb") as f:
        magic = f.read(4)
    if magic != _MAGIC:
        raise CheckpointError(
            f"{path} is not a GGUF file (it starts with {magic!r}, not {_MAGIC!r})"
        )
    return GGUFFile(path)


def _field(reader: GGUFFile, key: str, default: Any = None) -> Any:
    """One metadata value as a Python scalar or string, or a
    :class:`~kvpage.model.gguf_file.GGUFArray` (``default`` if absent)."""
    return reader.fields.get(key, default)


def _describe(value: Any) -> str:
    if isinstance(value, GGUFArray):
        return f"an array of {len(value)} {value_type_name(value.element_type)}"
    return f"{type(value).__name__} {value!r:.60}"


def _int_field(reader: GGUFFile, key: str, path: Path, default: int | None = None) -> int | None:
    """An integer metadata value (``default`` if absent); any other type is a
    :class:`CheckpointError` naming the key."""
    value = _field(reader, key, default)
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    raise CheckpointError(f"GGUF file {path}: metadata {key!r} is {_describe(value)}, "
                          "not an integer")


def _float_field(reader: GGUFFile, key: str, path: Path, default: float) -> float:
    """A finite number from the metadata (``default`` if absent)."""
    value = _field(reader, key, default)
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    raise CheckpointError(f"GGUF file {path}: metadata {key!r} is {_describe(value)}, "
                          "not a finite number")


def _architecture(reader: Any, path: Path) -> str:
    arch = _field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        raise CheckpointError(
            f"GGUF file {path} has architecture {arch!r}; supported: "
            f"{', '.join(SUPPORTED_GGUF_ARCHITECTURES)}"
        )
    return str(arch)


def _required_int(reader: Any, key: str, path: Path) -> int:
    value = _int_field(reader, key, path)
    if value is None:
        raise CheckpointError(f"GGUF file {path} lacks the integer metadata {key!r}")
    return value


def _tensor_shape(tensor: Any) -> tuple[int, ...]:
    """The HF/numpy shape (GGUF lists dimensions fastest-varying first)."""
    return tuple(int(d) for d in reversed(tuple(tensor.shape)))


def _rope(reader: Any, arch: str, head_dim: int, context: int, path: Path) -> RopeConfig:
    theta = _float_field(reader, f"{arch}.rope.freq_base", path, 10000.0)
    if theta <= 0:
        raise CheckpointError(f"GGUF file {path}: metadata '{arch}.rope.freq_base' is "
                              f"{theta}, not positive")
    scaling = _field(reader, f"{arch}.rope.scaling.type", "none")
    factor = _float_field(reader, f"{arch}.rope.scaling.factor", path, 1.0) or 1.0
    freqs = next((t for t in reader.tensors if t.name == _ROPE_FREQS), None)
    if freqs is not None:
        return _llama3_rope(reader, arch, freqs, theta, head_dim, context, path)
    if scaling in ("none", "") or (scaling == "linear" and factor == 1.0):
        return RopeConfig(theta=theta)
    if scaling == "linear":
        return RopeConfig(theta=theta, rope_type="linear", factor=factor)
    raise CheckpointError(
        f"GGUF file {path} uses rope scaling {scaling!r}; supported: none, linear, "
        "and Llama 3 frequency factors (rope_freqs.weight)"
    )


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
        _int_field(reader, f"{arch}.rope.scaling.original_context_length", path, 0)
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
    gguf_arch = _architecture(reader, path)
    architecture, _ = _ARCHITECTURES[gguf_arch]
    shapes = {t.name: _tensor_shape(t) for t in reader.tensors}
    if "token_embd.weight" not in shapes:
        raise CheckpointError(f"GGUF file {path} lacks the tensor 'token_embd.weight'")
    if len(shapes["token_embd.weight"]) != 2:
        raise CheckpointError(f"GGUF file {path}: tensor 'token_embd.weight' has shape "
                              f"{shapes['token_embd.weight']}, not [vocab, hidden]")
    vocab, hidden = shapes["token_embd.weight"]
    heads = _required_int(reader, f"{gguf_arch}.attention.head_count", path)
    if heads <= 0:
        raise CheckpointError(f"GGUF file {path} has {heads} attention heads")
    kv_heads = _int_field(reader, f"{gguf_arch}.attention.head_count_kv", path, heads)
    head_dim = (_int_field(reader, f"{gguf_arch}.attention.key_length", path, 0)
                or hidden // heads)
    rotary = _int_field(reader, f"{gguf_arch}.rope.dimension_count", path, head_dim)
    if rotary != head_dim:
        raise CheckpointError(
            f"GGUF file {path} rotates {rotary} of {head_dim} head features; "
            "partial rotary embeddings are not supported"
        )
    context = _required_int(reader, f"{gguf_arch}.context_length", path)
    eos = [
        _field(reader, f"tokenizer.ggml.{key}")
        for key in ("eos_token_id", "eot_token_id", "eom_token_id")
    ]
    if dtype == "auto":
        dtype = _auto_dtype(reader, device)
    jnp_dtype(dtype)
    try:
        return ModelConfig(
            architecture=architecture,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=_required_int(reader, f"{gguf_arch}.feed_forward_length", path),
            num_layers=_required_int(reader, f"{gguf_arch}.block_count", path),
            num_heads=heads,
            num_kv_heads=kv_heads,
            head_dim=head_dim,
            rms_norm_eps=_float_field(
                reader, f"{gguf_arch}.attention.layer_norm_rms_epsilon", path, 1e-6
            ),
            rope=_rope(reader, gguf_arch, head_dim, context, path),
            max_position_embeddings=context,
            tie_word_embeddings="output.weight" not in shapes,
            qkv_bias="blk.0.attn_q.bias" in shapes,
            o_proj_bias="blk.0.attn_output.bias" in shapes,
            mlp_bias="blk.0.ffn_gate.bias" in shapes,
            qk_norm="blk.0.attn_q_norm.weight" in shapes,
            dtype=dtype,
            eos_token_ids=tuple(sorted({
                int(e) for e in eos if isinstance(e, int) and not isinstance(e, bool)
            })),
        )
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
    return _config_from_reader(_open(path), path, dtype, device)


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
    return values.reshape(_tensor_shape(tensor))


def _unpermute_rope_rows(weight: np.ndarray, heads: int) -> np.ndarray:
    """Undo llama.cpp's per-head row permutation of a q/k weight or bias.

    The converter reshapes each head's rows to ``[2, head_dim/2]`` and transposes them
    to ``[head_dim/2, 2]``; this reshapes to ``[heads, head_dim/2, 2]`` and swaps back.
    """
    half = weight.shape[0] // heads // 2
    rows = weight.reshape(heads, half, 2, *weight.shape[1:])
    return rows.swapaxes(1, 2).reshape(weight.shape)


def _hf_name(gguf_name: str, num_layers: int) -> str | None:
    """The HF tensor name for a GGUF tensor name, or None if it is not a model weight."""
    if gguf_name.count(".") == 1:
        stem, kind = gguf_name.split(".")
        if stem in _TOP_TENSORS and kind == "weight":
            return f"{_TOP_TENSORS[stem]}.{kind}"
        return None
    match = _LAYER_NAME.fullmatch(gguf_name)
    if match is None or match.group(2) not in _LAYER_TENSORS:
        return None
    layer = int(match.group(1))
    if layer >= num_layers:
        return None
    return f"model.layers.{layer}.{_LAYER_TENSORS[match.group(2)]}.{match.group(3)}"


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
    reader = _open(path)
    config = _config_from_reader(reader, path, dtype, device)
    platform = device.platform if device is not None else jax.default_backend()
    keep = keeps_gguf_blocks(quantization, platform, tensor_parallel_size)
    params = _params_from_reader(
        reader, path, config, device, progress, keep_blocks=keep, int8=quantization == "int8"
    )
    return GGUFModel(config, params, _tokenizer(reader, path) if tokenizer else None)


def _params_from_reader(
    reader: Any,
    path: Path,
    config: ModelConfig,
    device: jax.Device | None,
    progress: Callable[[int, int], None] | None,
    keep_blocks: bool = False,
    int8: bool = False,
) -> Params:
    gguf_arch = _architecture(reader, path)
    permuted = _ARCHITECTURES[gguf_arch][1]
    target = jnp_dtype(config.dtype)
    spec = param_spec(config)
    flat: dict[str, Any] = {}
    tensors = [t for t in reader.tensors if t.name != _ROPE_FREQS]
    names = []
    for tensor in tensors:
        name = _hf_name(tensor.name, config.num_layers)
        if name is None or name not in spec:
            raise CheckpointError(
                f"GGUF file {path} holds tensor {tensor.name!r} of shape "
                f"{_tensor_shape(tensor)}, which a {gguf_arch} model does not use"
            )
        if _tensor_shape(tensor) != spec[name]:
            raise CheckpointError(
                f"tensor {tensor.name!r} ({name}) in {path} has shape "
                f"{_tensor_shape(tensor)}, expected {spec[name]}"
            )
        names.append(name)

    def unpermuted(tensor: Any, values: np.ndarray) -> np.ndarray:
        if permuted and (".attn_q." in tensor.name or ".attn_k." in tensor.name):
            heads = config.num_heads if ".attn_q." in tensor.name else config.num_kv_heads
            values = _unpermute_rope_rows(values, heads)
        return values

    def host_values(tensor: Any) -> np.ndarray | QuantizedWeight:
        shape = _tensor_shape(tensor)
        kind = GGUF_KEPT.get(tensor.tensor_type.name)
        if keep_blocks and kind is not None and len(shape) == 2:
            blocks = np.ascontiguousarray(unpermuted(tensor, tensor.data))
            return QuantizedWeight(blocks, kind, shape, target)
        values = unpermuted(tensor, _dequantize(tensor, path))
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
        for done, name in enumerate(names, start=1):
            while len(pending) < window and (tensor := next(upcoming, None)) is not None:
                pending.append(pool.submit(host_values, tensor))
            value = jax.device_put(pending.popleft().result(), device)
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


def load_gguf_tokenizer(path: str | Path) -> Any:
    """The Hugging Face tokenizer the file's ``tokenizer.*`` metadata describes, with its
    chat template (``tokenizer.chat_template``), or None if the file carries no
    vocabulary. Built by transformers' GGUF conversion, from the file alone."""
    path = Path(path)
    return _tokenizer(_open(path), path)


def _tokenizer(reader: Any, path: Path) -> Any:
    if "tokenizer.ggml.tokens" not in reader.fields:
        return None
    _check_vocabulary(reader, path)
    try:
        tokenizer = _tokenizer_from_metadata(reader, path)
        if tokenizer is None:
            tokenizer = _tokenizer_through_auto(path)
    except CheckpointError:
        raise
    except ImportError as err:
        raise ValueError(
            f"reading the tokenizer of {path} needs transformers' GGUF support: {err}"
        ) from None
    except Exception as err:  # transformers raises many types; name the file
        raise CheckpointError(f"cannot build the tokenizer of {path}: {err}") from None
    template = _field(reader, "tokenizer.chat_template")
    if template and not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = template
    return tokenizer


def _check_vocabulary(reader: Any, path: Path) -> None:
    """Check the tokenizer metadata's types and bound the arrays the tokenizer decodes
    before anything decodes them: a token list of strings, no longer than ``MAX_VOCAB`` or
    the embedding's rows, merges of strings, scores and token types one per token."""
    tokens = _field(reader, "tokenizer.ggml.tokens")
    if not isinstance(tokens, GGUFArray) or not tokens.strings:
        raise CheckpointError(f"GGUF file {path}: metadata 'tokenizer.ggml.tokens' is "
                              f"{_describe(tokens)}, not an array of strings")
    embedding = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
    shape = _tensor_shape(embedding) if embedding is not None else ()
    rows = shape[0] if len(shape) == 2 else MAX_VOCAB
    if not 0 < len(tokens) <= min(rows, MAX_VOCAB):
        raise CheckpointError(
            f"GGUF file {path}: 'tokenizer.ggml.tokens' holds {len(tokens)} tokens; at "
            f"least 1 and at most {min(rows, MAX_VOCAB)} (the embedding's rows, at most "
            f"{MAX_VOCAB}) are supported"
        )
    merges = _field(reader, "tokenizer.ggml.merges")
    if merges is not None and (not isinstance(merges, GGUFArray) or not merges.strings):
        raise CheckpointError(f"GGUF file {path}: metadata 'tokenizer.ggml.merges' is "
                              f"{_describe(merges)}, not an array of strings")
    for key in _TOKENIZER_STRINGS:
        value = _field(reader, key)
        if value is not None and not isinstance(value, str):
            raise CheckpointError(f"GGUF file {path}: metadata {key!r} is {_describe(value)}, "
                                  "not a string")
    for key in ("tokenizer.ggml.scores", "tokenizer.ggml.token_type"):
        values = _field(reader, key)
        if values is not None and (
            not isinstance(values, GGUFArray) or not values.numeric or len(values) != len(tokens)
        ):
            raise CheckpointError(f"GGUF file {path}: metadata {key!r} is {_describe(values)}, "
                                  f"not one number for each of the {len(tokens)} tokens")


def _tokenizer_value(reader: Any, key: str, path: Path) -> Any:
    """A tokenizer metadata value as transformers takes it: arrays decoded to lists, once
    their length is bounded."""
    value = _field(reader, key)
    if not isinstance(value, GGUFArray):
        return value
    if len(value) > MAX_VOCAB:
        raise CheckpointError(f"GGUF file {path}: metadata {key!r} is {_describe(value)}, "
                              f"more than the {MAX_VOCAB} supported")
    return value.tolist()


_TOKENIZER_STRINGS = ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template")
_SPECIAL_TOKEN_IDS = {
    "bos_token": "bos_token_id",
    "eos_token": "eos_token_id",
    "unk_token": "unknown_token_id",
    "pad_token": "padding_token_id",
}


def _tokenizer_from_metadata(reader: Any, path: Path) -> Any:
    """transformers' own GGUF tokenizer conversion fed from the already parsed metadata
    (transformers >= 5; None on older versions). Same result as
    ``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` without re-reading the file or
    importing torch."""
    try:
        from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer
    except ImportError:
        try:  # transformers < 5.13 (what kvpage[tunix] resolves to) keeps them here
            from transformers.integrations.ggml import (
                GGUF_TOKENIZER_MAPPING,
                convert_gguf_tokenizer,
            )
        except ImportError:
            return None
    from transformers import PreTrainedTokenizerFast

    groups = {
        group: {
            name: _tokenizer_value(reader, f"tokenizer.{key}", path)
            for key, name in renames.items()
            if f"tokenizer.{key}" in reader.fields
        }
        for group, renames in GGUF_TOKENIZER_MAPPING.items()
    }
    vocabulary, init = groups["tokenizer"], groups["tokenizer_config"]
    if vocabulary.get("tokenizer_type") == "llama":
        init.setdefault("add_bos_token", True)  # llama.cpp's default for sentencepiece
    tokens = vocabulary["tokens"]
    for name, key in _SPECIAL_TOKEN_IDS.items():
        token_id = _int_field(reader, f"tokenizer.ggml.{key}", path)
        if token_id is not None and not 0 <= token_id < len(tokens):
            raise CheckpointError(f"GGUF file {path}: 'tokenizer.ggml.{key}' is {token_id}, "
                                  f"not one of the {len(tokens)} token ids")
        init[name] = tokens[token_id] if token_id is not None else None
    backend, extra = convert_gguf_tokenizer(_field(reader, "general.architecture"), vocabulary)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **{**init, **extra})


def _tokenizer_through_auto(path: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True
    )
