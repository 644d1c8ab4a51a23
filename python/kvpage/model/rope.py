"""Rotary position embeddings: inverse frequencies, cos/sin tables and the rotation.

This file owns RoPE for every supported ``rope_type`` (``default``, ``linear``,
``llama3``, ``yarn``, ``longrope``, ``dynamic``), matching transformers'
``ROPE_INIT_FUNCTIONS`` and its rotary embedding modules (float32 throughout). The
"static" types have one frequency vector, computed once on the host from the config;
the cos/sin tables are computed on device from each token's absolute position, so
prefill chunks and decodes of different sequences share one code path. The rotation is
the "rotate half" convention of HF Llama-family checkpoints (feature ``i`` pairs with
feature ``i + head_dim / 2``).

Attention scaling. ``yarn`` and ``longrope`` multiply cos and sin by an attention factor
(YaRN's "mscale"; LongRoPE's ``sqrt(1 + log(factor) / log(original))``), so q.k is
scaled by its square, exactly as transformers does; :func:`attention_scaling` gives it.

Length-dependent types in a paged engine. transformers chooses ``longrope``'s short or
long factors, and ``dynamic``'s NTK base, once per forward call from
``seq_len = max(position_ids) + 1``; the keys it caches keep the rotation of the call
that computed them. kvpage mixes sequences of different lengths in one step, so it makes
the same choice per sequence and per step: every token uses the KV length its sequence
reaches at the end of this step (``kv_lens`` of its row, which is its largest position
in the step + 1). For one sequence this is transformers' rule exactly: a prompt
prefilled in one step uses its full length, every decode step the length after the
token, and cached keys keep the rotation they were written with (vLLM instead picks
longrope's factors per position / uses a fixed NTK base; neither matches transformers).

* ``longrope``: the long factors when that length exceeds
  ``original_max_position_embeddings``, else the short ones; the attention factor applies
  on both sides. A sequence that crosses the threshold while decoding keeps its earlier
  keys short-rotated, as transformers' Llama does (Phi-3's ``generate`` instead drops
  its cache at the crossing and recomputes; kvpage does not).
* ``dynamic``: the NTK base ``theta * (factor * L / max_pos - (factor - 1)) **
  (d / (d - 2))`` for ``L = max(length, max_position_embeddings)``, so plain RoPE up to
  ``max_position_embeddings``. transformers' module also keeps the largest length seen
  across calls (a later, shorter sequence still above the threshold reuses the larger
  base); kvpage is stateless and uses each sequence's own length.

Where kvpage's rotations differ from transformers' for these two types (only when the
sequence ends up on the other side of the threshold than some of its tokens' steps):
a prompt prefilled in several chunks (each chunk uses the length at its end, not the
prompt length), KV blocks reused from the prefix cache (they keep the rotation of the
sequence that wrote them), and a preempted sequence recomputed in one step (all its
tokens take the length at the recompute). ``dynamic`` can only exceed the threshold
when the forward pass is called with longer sequences than ``max_position_embeddings``
(the model runner caps ``max_model_len`` at it).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from kvpage.model.config import ModelConfig, RopeConfig

# Types whose frequencies depend on the sequence's length (see the module docstring).
LENGTH_DEPENDENT_ROPE_TYPES: tuple[str, ...] = ("longrope", "dynamic")


def _theta_powers(head_dim: int, theta: float) -> np.ndarray:
    """float32 ``theta ** (2i / head_dim)``: the float32 exponents as transformers computes
    them, the power in float64 rounded once (numpy's float32 ``power`` is often 1 ulp
    off torch's, which shifts the angle at position p by p ulps)."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(
        head_dim
    )
    return np.power(np.float64(theta), exponents.astype(np.float64)).astype(np.float32)


def _base_inverse_frequencies(head_dim: int, theta: float) -> np.ndarray:
    return (np.float32(1.0) / _theta_powers(head_dim, theta)).astype(np.float32)


def inverse_frequencies(
    head_dim: int, rope: RopeConfig, max_position_embeddings: int
) -> np.ndarray:
    """float32 ``[head_dim // 2]`` angular frequency of each rotated feature pair.

    For the length-dependent types these are the frequencies of a sequence no longer
    than the threshold: ``longrope``'s short factors, ``dynamic``'s unscaled base.
    """
    inv_freq = _base_inverse_frequencies(head_dim, rope.theta)
    if rope.rope_type in ("default", "dynamic"):
        return inv_freq
    if rope.rope_type == "linear":
        return (inv_freq / np.float32(rope.factor)).astype(np.float32)
    if rope.rope_type == "llama3":
        return _llama3_scaling(inv_freq, rope, max_position_embeddings)
    if rope.rope_type == "yarn":
        return _yarn(head_dim, rope, max_position_embeddings)
    if rope.rope_type == "longrope":
        return _longrope(head_dim, rope, rope.short_factor)
    raise ValueError(f"unsupported rope_type {rope.rope_type!r}")


def long_inverse_frequencies(head_dim: int, rope: RopeConfig) -> np.ndarray:
    """``longrope``'s frequencies for sequences longer than its original context."""
    if rope.rope_type != "longrope":
        raise ValueError(f"rope_type {rope.rope_type!r} has no long factors")
    return _longrope(head_dim, rope, rope.long_factor)


def attention_scaling(rope: RopeConfig, max_position_embeddings: int) -> float:
    """The factor transformers multiplies cos and sin by (1.0 except yarn / longrope)."""
    if rope.attention_factor is not None and rope.rope_type in ("yarn", "longrope"):
        return float(rope.attention_factor)
    original = rope.original_max_position_embeddings or max_position_embeddings
    if rope.rope_type == "yarn":
        if rope.mscale and rope.mscale_all_dim:
            return float(
                _yarn_mscale(rope.factor, rope.mscale)
                / _yarn_mscale(rope.factor, rope.mscale_all_dim)
            )
        return _yarn_mscale(rope.factor)
    if rope.rope_type == "longrope":
        if rope.factor <= 1.0:
            return 1.0
        return math.sqrt(1 + math.log(rope.factor) / math.log(original))
    return 1.0


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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


def _yarn(head_dim: int, rope: RopeConfig, max_position_embeddings: int) -> np.ndarray:
    # YaRN: per pair, blend the interpolated (divided by ``factor``) and the original
    # ("extrapolated") frequency by a linear ramp over the pairs whose number of
    # rotations within the original context lies between beta_slow and beta_fast.
    original = rope.original_max_position_embeddings or max_position_embeddings
    dim, base = head_dim, rope.theta

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # as transformers: avoid a zero-width ramp

    pos_freqs = _theta_powers(dim, base)
    extrapolation = np.float32(1.0) / pos_freqs
    interpolation = np.float32(1.0) / (np.float32(rope.factor) * pos_freqs)
    ramp = (np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low)
    extrapolation_weight = np.float32(1.0) - np.clip(ramp, 0, 1).astype(np.float32)
    inv_freq = (
        interpolation * (np.float32(1.0) - extrapolation_weight)
        + extrapolation * extrapolation_weight
    )
    return inv_freq.astype(np.float32)


def _longrope(head_dim: int, rope: RopeConfig, factors: tuple[float, ...]) -> np.ndarray:
    ext = np.asarray(factors, dtype=np.float32)
    if ext.shape != (head_dim // 2,):
        raise ValueError(f"longrope factors have {ext.size} values, expected {head_dim // 2}")
    return (np.float32(1.0) / (ext * _theta_powers(head_dim, rope.theta))).astype(np.float32)


def config_inverse_frequencies(config: ModelConfig, rope: RopeConfig | None = None) -> np.ndarray:
    """:func:`inverse_frequencies` of ``config`` (the below-threshold ones for the
    length-dependent types; :func:`config_rope_cos_sin` handles those fully)."""
    return inverse_frequencies(
        config.rotary_dim, rope or config.rope, config.max_position_embeddings
    )


def token_sequence_lengths(
    cu_q_lens: jax.Array, kv_lens: jax.Array, num_tokens: int
) -> jax.Array:
    """int32 ``[num_tokens]``: the KV length after this step of each token's sequence.

    ``cu_q_lens`` is non-decreasing (padding rows repeat the last value), so token ``t``
    belongs to row ``i`` with ``cu_q_lens[i] <= t < cu_q_lens[i + 1]``. Padding tokens get
    some row's length (their outputs are never read).
    """
    rows = jnp.searchsorted(cu_q_lens, jnp.arange(num_tokens, dtype=cu_q_lens.dtype),
                            side="right") - 1
    return kv_lens[jnp.clip(rows, 0, kv_lens.shape[0] - 1)].astype(jnp.int32)


def _dynamic_inverse_frequencies(
    head_dim: int, rope: RopeConfig, max_position_embeddings: int, lengths: jax.Array
) -> jax.Array:
    # transformers' ``_compute_dynamic_ntk_parameters`` with a tensor ``seq_len``, per
    # token, in the same float32 operation order.
    plain = jnp.asarray(_base_inverse_frequencies(head_dim, rope.theta))
    max_pos = max_position_embeddings
    length = jnp.maximum(lengths, max_pos).astype(jnp.float32)
    factor = jnp.float32(rope.factor)
    ratio = factor * length / jnp.float32(max_pos) - jnp.float32(rope.factor - 1)
    base = jnp.float32(rope.theta) * ratio ** jnp.float32(head_dim / (head_dim - 2))
    exponents = jnp.arange(0, head_dim, 2, dtype=jnp.float32) / jnp.float32(head_dim)
    scaled = 1.0 / (base[:, None] ** exponents[None, :])
    return jnp.where((lengths > max_pos)[:, None], scaled, plain[None, :])


def config_rope_cos_sin(
    config: ModelConfig,
    positions: jax.Array,
    cu_q_lens: jax.Array | None = None,
    kv_lens: jax.Array | None = None,
    rope: RopeConfig | None = None,
) -> tuple[jax.Array, jax.Array]:
    """float32 ``cos, sin`` ``[T, rotary_dim]`` of ``config``'s RoPE (or ``rope``, e.g.
    the sliding layers' :attr:`~ModelConfig.rope_local`), attention scaling included, for
    int positions ``[T]``.

    The length-dependent types need each token's sequence length: from the paged step's
    ``cu_q_lens`` / ``kv_lens`` (see the module docstring), or, without them, the largest
    position + 1 of the whole batch (transformers' rule for a padded dense batch).
    """
    rope = rope or config.rope
    scale = attention_scaling(rope, config.max_position_embeddings)
    if rope.rope_type not in LENGTH_DEPENDENT_ROPE_TYPES:
        return rope_cos_sin(positions, config_inverse_frequencies(config, rope), scale)
    num_tokens = positions.shape[0]
    if cu_q_lens is None or kv_lens is None:
        lengths = jnp.broadcast_to(jnp.max(positions).astype(jnp.int32) + 1, (num_tokens,))
    else:
        lengths = token_sequence_lengths(cu_q_lens, kv_lens, num_tokens)
    if rope.rope_type == "longrope":
        original = rope.original_max_position_embeddings or config.max_position_embeddings
        short = jnp.asarray(config_inverse_frequencies(config, rope))
        long = jnp.asarray(long_inverse_frequencies(config.rotary_dim, rope))
        inv_freq = jnp.where((lengths > original)[:, None], long[None, :], short[None, :])
    else:
        inv_freq = _dynamic_inverse_frequencies(
            config.rotary_dim, rope, config.max_position_embeddings, lengths
        )
    return rope_cos_sin(positions, inv_freq, scale)


def table_rope_cos_sin(
    config: ModelConfig, positions: jax.Array, length: int, rope: RopeConfig | None = None
) -> tuple[jax.Array, jax.Array]:
    """:func:`config_rope_cos_sin` read from a table of positions ``0..length`` computed
    when the step is traced (a constant of the executable), for batch-invariant steps:
    XLA:CPU evaluates ``cos`` / ``sin`` with code that depends on the array's shape (a
    decode step of one row and one of four gave different last bits), a gather does
    not. The length-dependent types (``dynamic``, ``longrope``) are refused."""
    rope = rope or config.rope
    if rope.rope_type in LENGTH_DEPENDENT_ROPE_TYPES:
        raise NotImplementedError(f"batch_invariant does not support RoPE type "
                                  f"{rope.rope_type!r} yet")
    with jax.ensure_compile_time_eval():
        cos, sin = config_rope_cos_sin(config, jnp.arange(length, dtype=jnp.int32), rope=rope)
    return jnp.take(cos, positions, axis=0), jnp.take(sin, positions, axis=0)


def rope_cos_sin(
    positions: jax.Array, inv_freq: np.ndarray | jax.Array, attention_factor: float = 1.0
) -> tuple[jax.Array, jax.Array]:
    """float32 ``cos, sin`` of shape ``[T, head_dim]`` for int positions ``[T]``;
    ``inv_freq`` is ``[head_dim // 2]`` or per token ``[T, head_dim // 2]``; both tables
    are multiplied by ``attention_factor``."""
    inv = jnp.asarray(inv_freq, jnp.float32)
    if inv.ndim == 1:
        inv = inv[None, :]
    angles = positions.astype(jnp.float32)[:, None] * inv
    angles = jnp.concatenate([angles, angles], axis=-1)
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    if attention_factor != 1.0:
        cos, sin = cos * jnp.float32(attention_factor), sin * jnp.float32(attention_factor)
    return cos, sin


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, exact: bool = False) -> jax.Array:
    """Rotate ``x`` ``[T, heads, head_dim]`` by per-token angles (``cos``/``sin``
    ``[T, D]``); with ``D < head_dim`` (partial RoPE) only the first ``D`` features
    rotate and the rest pass through.

    ``exact`` (the serving step): on CPU each output is ``x * cos + rotated * sin``
    rounded once, whatever step it is computed in. XLA:CPU lets LLVM fuse a multiply
    into the add (FMA), and which of the two products it fuses, if any, depends on
    the fusion the rotation lands in: a token's rotated key came out different in
    the last bit in a one-row decode step and in a prompt step of a model of eight
    layers, so ``batch_invariant`` generation and ``LLM.score`` of the same tokens
    differed by up to 4.7e-4 in logprob on Qwen2.5-Coder-0.5B Q4_K_M. In float64
    both float32 products are exact, so every fusion choice rounds the same sum.
    Other platforms keep float32."""
    rotary = cos.shape[-1]
    if rotary < x.shape[-1]:
        return jnp.concatenate(
            [apply_rope(x[..., :rotary], cos, sin, exact), x[..., rotary:]], axis=-1
        )

    def rotate(dtype: jnp.dtype) -> jax.Array:
        half = x.shape[-1] // 2
        xf = x.astype(dtype)
        rotated = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
        out = xf * cos.astype(dtype)[:, None, :] + rotated * sin.astype(dtype)[:, None, :]
        return out.astype(jnp.float32).astype(x.dtype)

    if not exact:
        return rotate(jnp.float32)

    def on_cpu() -> jax.Array:
        with jax.enable_x64(True):
            return rotate(jnp.float64)

    return jax.lax.platform_dependent(cpu=on_cpu, default=lambda: rotate(jnp.float32))
