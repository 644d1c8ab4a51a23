"""Rotary position embeddings: inverse frequencies (default, linear, llama3) and rotation.

This file owns RoPE. Frequencies are computed once on the host from the config; the
cos/sin tables are computed on device from each token's absolute position, so prefill
chunks and decodes of different sequences share one code path. The rotation is the
"rotate half" convention of HF Llama-family checkpoints (feature ``i`` pairs with
feature ``i + head_dim / 2``).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from kvpage.model.config import ModelConfig, RopeConfig


def inverse_frequencies(
    head_dim: int, rope: RopeConfig, max_position_embeddings: int
) -> np.ndarray:
    """float32 ``[head_dim // 2]`` angular frequency of each rotated feature pair."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(
        head_dim
    )
    inv_freq = (1.0 / np.power(np.float32(rope.theta), exponents)).astype(np.float32)
    if rope.rope_type == "default":
        return inv_freq
    if rope.rope_type == "linear":
        return (inv_freq / np.float32(rope.factor)).astype(np.float32)
    if rope.rope_type == "llama3":
        return _llama3_scaling(inv_freq, rope, max_position_embeddings)
    raise ValueError(f"unsupported rope_type {rope.rope_type!r}")


def _llama3_scaling(
    inv_freq: np.ndarray, rope: RopeConfig, max_position_embeddings: int
) -> np.ndarray:
    # Llama 3.1: wavelengths longer than the original context / low_freq_factor are slowed
    # down by ``factor``; shorter than original / high_freq_factor are kept; in between,
    # interpolate linearly in (original_context / wavelength).
    original = rope.original_max_position_embeddings or max_position_embeddings
    factor = np.float32(rope.factor)
    low, high = np.float32(rope.low_freq_factor), np.float32(rope.high_freq_factor)
    wavelength = np.float32(2 * math.pi) / inv_freq
    long_limit = np.float32(original) / low
    short_limit = np.float32(original) / high
    scaled = np.where(wavelength > long_limit, inv_freq / factor, inv_freq)
    blend = (np.float32(original) / wavelength - low) / (high - low)
    blended = (1 - blend) * scaled / factor + blend * scaled
    in_between = (wavelength >= short_limit) & (wavelength <= long_limit)
    return np.where(in_between, blended, scaled).astype(np.float32)


def config_inverse_frequencies(config: ModelConfig) -> np.ndarray:
    return inverse_frequencies(config.head_dim, config.rope, config.max_position_embeddings)


def rope_cos_sin(positions: jax.Array, inv_freq: np.ndarray) -> tuple[jax.Array, jax.Array]:
    """float32 ``cos, sin`` of shape ``[T, head_dim]`` for int positions ``[T]``."""
    angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq)[None, :]
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles), jnp.sin(angles)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate ``x`` ``[T, heads, head_dim]`` by per-token angles (``cos``/``sin`` ``[T, D]``)."""
    half = x.shape[-1] // 2
    xf = x.astype(jnp.float32)
    rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = xf * cos[:, None, :] + rotated * sin[:, None, :]
    return out.astype(x.dtype)
