"""Device-side token sampling for a whole step in one batched computation.

This file owns the sampling math. Every per-row knob is an array, so one compiled
function serves any mix of greedy and random rows and any parameter values:

1. raw log-probabilities (``log_softmax`` of the model logits) -- what logprobs report by
   default (each row's ``logprobs_mode`` may ask for the raw logits, or for the processed
   logits or log-probabilities: those the token was drawn from, after steps 2-4);
2. penalties (vLLM semantics): repetition over prompt + output tokens, then frequency and
   presence over output tokens;
2b. min_tokens (vLLM semantics): while a row has generated fewer than ``min_tokens`` tokens,
   its stop tokens (EOS unless ``ignore_eos``, and ``stop_token_ids``) are masked, so
   neither greedy nor random sampling can pick them;
2c. structured outputs: the grammar's token bitmask (:mod:`kvpage.sampling.token_bitmask`)
   sets disallowed tokens to -inf, before temperature, min-p, top-k and top-p. When
   min_tokens would mask every token the grammar allows (the grammar is complete and
   allows only EOS), the grammar wins;
3. greedy rows (temperature 0) take the argmax of the penalised logits;
4. other rows: divide by temperature, apply min-p, then top-k and top-p, then draw with the
   Gumbel-max trick using a per-row key. A seeded row's key depends only on
   ``(seed, index of the token being generated)``, never on the batch around it.

Expensive stages (penalties, the vocabulary sort behind top-k/top-p, random draws, the
top-N logprob list) sit behind ``lax.cond`` so batches that do not use them skip them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp

from kvpage.model.row_reductions import first_max_index, log_softmax
from kvpage.sampling.categorical import draw_categorical
from kvpage.sampling.device_params import GREEDY_EPSILON
from kvpage.sampling.token_bitmask import apply_token_bitmask


class SamplingInputs(NamedTuple):
    """Per-row sampling parameters, all ``[N]`` except the two ``[N, vocab]`` histories."""

    temperature: jax.Array  # f32
    top_k: jax.Array  # i32, <= 0 means off
    top_p: jax.Array  # f32, 1 means off
    min_p: jax.Array  # f32, 0 means off
    presence_penalty: jax.Array  # f32
    frequency_penalty: jax.Array  # f32
    repetition_penalty: jax.Array  # f32
    seed: jax.Array  # u32 [N, 2]: low and high 32-bit words of the request's seed
    has_seed: jax.Array  # bool
    step: jax.Array  # i32: index of the token being generated within its request
    output_counts: jax.Array | None  # i32 [N, V]: occurrences in the generated output
    prompt_mask: jax.Array | None  # bool [N, V]: token appears in the prompt
    min_tokens: jax.Array | None = None  # i32: stop tokens are masked while step < min_tokens
    stop_mask: jax.Array | None = None  # bool [N, V]: the row's stop tokens
    logprobs_mode: jax.Array | None = None  # i32: code into LOGPROBS_MODES (None: raw)


class SamplerOutput(NamedTuple):
    token_ids: jax.Array  # i32 [N]
    logprobs: jax.Array  # f32 [N]  the chosen token's value in the row's logprobs_mode
    ranks: jax.Array  # i32 [N]  1 + number of tokens strictly more likely
    top_token_ids: jax.Array  # i32 [N, K]
    top_logprobs: jax.Array  # f32 [N, K]


def apply_penalties(
    logits: jax.Array,
    output_counts: jax.Array,
    prompt_mask: jax.Array,
    presence_penalty: jax.Array,
    frequency_penalty: jax.Array,
    repetition_penalty: jax.Array,
) -> jax.Array:
    """Repetition (prompt + output), then frequency and presence (output only)."""
    generated = output_counts > 0
    seen = generated | prompt_mask
    rep = repetition_penalty[:, None]
    logits = jnp.where(seen, jnp.where(logits > 0, logits / rep, logits * rep), logits)
    logits = logits - frequency_penalty[:, None] * output_counts.astype(logits.dtype)
    return logits - presence_penalty[:, None] * generated.astype(logits.dtype)


def apply_min_tokens(
    logits: jax.Array, step: jax.Array, min_tokens: jax.Array, stop_mask: jax.Array
) -> jax.Array:
    """Mask each row's stop tokens while it has generated fewer than ``min_tokens``."""
    suppress = (step < min_tokens)[:, None] & stop_mask
    return jnp.where(suppress, -jnp.inf, logits)


def apply_min_p(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    """Mask tokens with probability below ``min_p`` x the row's top probability."""
    top = jnp.max(logits, axis=-1, keepdims=True)
    threshold = top + jnp.log(min_p)[:, None]  # log(0) = -inf keeps everything
    return jnp.where(logits >= threshold, logits, -jnp.inf)


def _order_keys(values: jax.Array) -> jax.Array:
    """int32 keys ordered like the float32 ``values`` (``a < b`` iff ``key(a) < key(b)``
    for non-NaN floats; -inf and inf map to the ends)."""
    values = values.astype(jnp.float32)
    values = jnp.where(values == 0.0, 0.0, values)  # -0.0 and 0.0 are one value
    bits = jax.lax.bitcast_convert_type(values, jnp.int32)
    return jnp.where(bits < 0, bits ^ jnp.int32(0x7FFFFFFF), bits)


def _smallest_key_where(
    keys: jax.Array, low: jax.Array, high: jax.Array, holds: Callable[[jax.Array], jax.Array]
) -> jax.Array:
    """Per row, the smallest int32 ``t`` in ``[low, high]`` with ``holds(t)`` true, for a
    ``holds`` that is monotone in ``t`` (false ... false true ... true) and true at ``high``.
    A bisection over the key range: 32 passes over ``keys``, no sort."""

    def body(_: int, bounds: tuple[jax.Array, jax.Array]) -> tuple[jax.Array, jax.Array]:
        lo, hi = bounds
        # hi - lo may not fit an int32; as uint32 it is exact (hi >= lo), and half of it does.
        half = ((hi.astype(jnp.uint32) - lo.astype(jnp.uint32)) >> 1).astype(jnp.int32)
        mid = lo + half
        ok = holds(mid)
        return jnp.where(ok, lo, mid + 1), jnp.where(ok, mid, hi)

    _, hi = jax.lax.fori_loop(0, 32, body, (low, high))
    return hi


def apply_top_k_top_p(logits: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Mask everything outside each row's top-k, then outside its top-p nucleus.

    The nucleus is the smallest set of most likely tokens (among the top-k survivors)
    whose probability reaches ``top_p``; the most likely token is always kept. Tokens tied
    with a boundary token are kept too.

    Both thresholds are found exactly without sorting the vocabulary (a full sort of
    ``[rows, vocab]`` cost 680 ms per step at 64 rows x 49k vocab on a 2-core CPU):
    a bisection over the logits' order-preserving int32 keys. The k-th largest value is
    the largest key with at least k tokens at or above it; the nucleus threshold is the
    smallest key whose strictly-greater tokens hold less than ``top_p`` of the mass.
    """
    vocab = logits.shape[-1]
    keys = _order_keys(logits)
    low = jnp.min(keys, axis=-1)
    high = jnp.max(keys, axis=-1)
    k = jnp.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)

    def fewer_than_k_above(t: jax.Array) -> jax.Array:  # count(key > t) < k
        return jnp.sum(keys > t[:, None], axis=-1) < k

    # The k-th largest key is the smallest t with fewer than k tokens strictly above it.
    kth = jax.lax.cond(
        jnp.any(k < vocab),
        lambda: _smallest_key_where(keys, low, high, fewer_than_k_above),
        lambda: low,
    )
    in_top_k = keys >= kth[:, None]
    probs = jax.nn.softmax(jnp.where(in_top_k, logits, -jnp.inf), axis=-1)

    def little_mass_above(t: jax.Array) -> jax.Array:  # mass(key > t) < top_p
        return jnp.sum(jnp.where(keys > t[:, None], probs, 0.0), axis=-1) < top_p

    nucleus = jax.lax.cond(
        jnp.any(top_p < 1.0),
        lambda: _smallest_key_where(keys, kth, high, little_mass_above),
        lambda: kth,
    )
    threshold = jnp.where(top_p >= 1.0, kth, jnp.maximum(nucleus, kth))
    return jnp.where(keys >= threshold[:, None], logits, -jnp.inf)


def row_keys(
    seed: jax.Array, has_seed: jax.Array, step: jax.Array, unseeded_key: jax.Array
) -> jax.Array:
    """One PRNG key per row.

    Seeded rows: ``fold_in(fold_in(key(seed_low), seed_high), step)`` -- a function of the
    request's 64-bit seed and the index of the token being generated only. Other rows:
    ``fold_in(unseeded_key, row)``.
    """

    def one(seed_: jax.Array, has: jax.Array, step_: jax.Array, row: jax.Array) -> jax.Array:
        base = jax.random.fold_in(jax.random.key(seed_[0]), seed_[1])
        seeded = jax.random.key_data(jax.random.fold_in(base, step_))
        unseeded = jax.random.key_data(jax.random.fold_in(unseeded_key, row))
        return jnp.where(has, seeded, unseeded)

    rows = jnp.arange(seed.shape[0], dtype=jnp.int32)
    return jax.random.wrap_key_data(jax.vmap(one)(seed, has_seed, step, rows))


def _random_tokens(
    logits: jax.Array, inputs: SamplingInputs, is_greedy: jax.Array, unseeded_key: jax.Array
) -> tuple[jax.Array, jax.Array]:
    """The drawn tokens, and the processed logits they were drawn from."""
    temperature = jnp.where(is_greedy, 1.0, inputs.temperature)
    scaled = logits / temperature[:, None]
    scaled = jax.lax.cond(
        jnp.any(inputs.min_p > 0.0),
        lambda x: apply_min_p(x, inputs.min_p),
        lambda x: x,
        scaled,
    )
    needs_sort = jnp.any((inputs.top_k > 0) & (inputs.top_k < logits.shape[-1])) | jnp.any(
        inputs.top_p < 1.0
    )
    scaled = jax.lax.cond(
        needs_sort,
        lambda x: apply_top_k_top_p(x, inputs.top_k, inputs.top_p),
        lambda x: x,
        scaled,
    )
    keys = row_keys(inputs.seed, inputs.has_seed, inputs.step, unseeded_key)
    return draw_categorical(scaled, keys), scaled


def _logprobs_in_mode(
    mode: jax.Array, raw_logits: jax.Array, raw_logprobs: jax.Array, processed: jax.Array
) -> jax.Array:
    """Per row, the values its ``logprobs_mode`` reports (codes of ``LOGPROBS_MODES``)."""
    mode = mode[:, None]
    processed_values = jnp.where(mode == 3, processed, log_softmax(processed))
    raw_values = jnp.where(mode == 1, raw_logits, raw_logprobs)
    return jnp.where(mode >= 2, processed_values, raw_values)


def sample(
    logits: jax.Array,
    inputs: SamplingInputs,
    unseeded_key: jax.Array,
    num_top_logprobs: int,
    want_top_logprobs: jax.Array | bool = True,
    token_bitmask: jax.Array | None = None,
) -> SamplerOutput:
    """Pick one token per row of float32 ``logits [N, vocab]``.

    ``num_top_logprobs`` (static) is the width K of the top-N lists; they are computed only
    when ``want_top_logprobs`` is true (zeros otherwise). ``token_bitmask`` (int32
    ``[N, ceil(vocab / 32)]``, see :mod:`kvpage.sampling.token_bitmask`) restricts each row
    to the tokens its grammar allows; None or all-ones rows restrict nothing.
    """
    logits = logits.astype(jnp.float32)
    raw_logits = logits
    raw_logprobs = log_softmax(logits)
    if inputs.output_counts is not None and inputs.prompt_mask is not None:
        active = (
            jnp.any(inputs.presence_penalty != 0.0)
            | jnp.any(inputs.frequency_penalty != 0.0)
            | jnp.any(inputs.repetition_penalty != 1.0)
        )
        logits = jax.lax.cond(
            active,
            lambda x: apply_penalties(
                x,
                inputs.output_counts,
                inputs.prompt_mask,
                inputs.presence_penalty,
                inputs.frequency_penalty,
                inputs.repetition_penalty,
            ),
            lambda x: x,
            logits,
        )
    if token_bitmask is not None:
        logits = apply_token_bitmask(logits, token_bitmask)
    grammar_logits = logits
    if inputs.min_tokens is not None and inputs.stop_mask is not None:
        logits = jax.lax.cond(
            jnp.any(inputs.step < inputs.min_tokens),
            lambda x: apply_min_tokens(x, inputs.step, inputs.min_tokens, inputs.stop_mask),
            lambda x: x,
            logits,
        )
        if token_bitmask is not None:  # never leave a row without a candidate
            dead = jnp.all(logits == -jnp.inf, axis=-1, keepdims=True)
            logits = jnp.where(dead, grammar_logits, logits)
    is_greedy = inputs.temperature < GREEDY_EPSILON
    # A pass over the vocabulary that sampled-only steps (RL rollouts) skip.
    greedy_tokens = jax.lax.cond(
        jnp.any(is_greedy),
        first_max_index,
        lambda x: jnp.zeros(x.shape[0], jnp.int32),
        logits,
    )
    random_tokens, drawn_from = jax.lax.cond(
        jnp.all(is_greedy),
        lambda x: (greedy_tokens, x),
        lambda x: _random_tokens(x, inputs, is_greedy, unseeded_key),
        logits,
    )
    tokens = jnp.where(is_greedy, greedy_tokens, random_tokens)
    reported = raw_logprobs
    if inputs.logprobs_mode is not None:
        processed = jnp.where(is_greedy[:, None], logits, drawn_from)
        reported = jax.lax.cond(
            jnp.any(inputs.logprobs_mode != 0),
            lambda: _logprobs_in_mode(inputs.logprobs_mode, raw_logits, raw_logprobs, processed),
            lambda: raw_logprobs,
        )
    chosen = jnp.take_along_axis(reported, tokens[:, None], axis=-1)[:, 0]
    ranks = 1 + jnp.sum(reported > chosen[:, None], axis=-1).astype(jnp.int32)

    n = logits.shape[0]
    if num_top_logprobs > 0:

        def top(x: jax.Array) -> tuple[jax.Array, jax.Array]:
            values, ids = jax.lax.top_k(x, num_top_logprobs)
            return ids.astype(jnp.int32), values

        def skip(x: jax.Array) -> tuple[jax.Array, jax.Array]:
            return (
                jnp.zeros((n, num_top_logprobs), jnp.int32),
                jnp.zeros((n, num_top_logprobs), jnp.float32),
            )

        top_ids, top_values = jax.lax.cond(jnp.asarray(want_top_logprobs), top, skip, reported)
    else:
        top_ids = jnp.zeros((n, 0), jnp.int32)
        top_values = jnp.zeros((n, 0), jnp.float32)
    return SamplerOutput(tokens, chosen, ranks, top_ids, top_values)
