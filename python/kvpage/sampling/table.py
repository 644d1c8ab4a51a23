"""Device-resident sampling state of every seat (a request's row).

This file owns :class:`SamplingTable`: one row per seat (``max_num_seqs`` of them,
plus a dummy last row that padded sample rows point at) holding the request's sampling
parameters, the index of its next generated token (for seeded keys and min_tokens), its
stop-token mask over the vocabulary (masked until min_tokens) and -- when penalties are
enabled -- its output token counts and prompt-token mask over the vocabulary.

Because the table lives on device and is indexed by ``plan.sample_rows`` inside the
jitted step, a step sends no per-row sampling data from the host, and updating a row
(:func:`write_seat`) is one fixed-shape call that never recompiles.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from kvpage.sampling.device_params import DeviceSamplingParams
from kvpage.sampling.sampler import SamplingInputs

# Columns of SamplingTable.floats
TEMPERATURE, TOP_P, MIN_P, PRESENCE, FREQUENCY, REPETITION = range(6)
NUM_FLOAT_COLUMNS = 6
# Columns of SamplingTable.ints
TOP_K, HAS_SEED, STEP, MIN_TOKENS, LOGPROBS_MODE = range(5)
NUM_INT_COLUMNS = 5


class SamplingTable(NamedTuple):
    floats: jax.Array  # f32 [R + 1, 6]
    ints: jax.Array  # i32 [R + 1, 5]
    seeds: jax.Array  # u32 [R + 1, 2]: low and high words of each request's seed
    output_counts: jax.Array | None  # i32 [R + 1, V]
    prompt_mask: jax.Array | None  # bool [R + 1, V]
    stop_mask: jax.Array  # bool [R + 1, V]: stop tokens, masked while STEP < MIN_TOKENS


def params_to_rows(
    params: DeviceSamplingParams, num_generated: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The float row, int row and seed that :func:`write_seat` stores for ``params``."""
    floats = np.zeros(NUM_FLOAT_COLUMNS, np.float32)
    floats[TEMPERATURE] = params.temperature
    floats[TOP_P] = params.top_p
    floats[MIN_P] = params.min_p
    floats[PRESENCE] = params.presence_penalty
    floats[FREQUENCY] = params.frequency_penalty
    floats[REPETITION] = params.repetition_penalty
    ints = np.zeros(NUM_INT_COLUMNS, np.int32)
    ints[TOP_K] = max(params.top_k, 0)
    ints[HAS_SEED] = params.seed is not None
    ints[STEP] = num_generated
    ints[MIN_TOKENS] = params.min_tokens
    ints[LOGPROBS_MODE] = params.logprobs_mode
    seed_value = params.seed or 0
    seed = np.asarray([seed_value & 0xFFFFFFFF, (seed_value >> 32) & 0xFFFFFFFF], np.uint32)
    return floats, ints, seed


def stop_mask_row(params: DeviceSamplingParams, vocab_size: int) -> np.ndarray:
    """The ``bool [vocab]`` stop-token row :func:`write_seat` stores for ``params`` (empty
    when ``min_tokens`` is 0: nothing is ever masked then)."""
    row = np.zeros(vocab_size, np.bool_)
    if params.min_tokens > 0:
        ids = np.asarray(params.stop_token_ids, np.int64)
        row[ids[(ids >= 0) & (ids < vocab_size)]] = True
    return row


def init_sampling_table(
    num_seats: int, vocab_size: int, enable_penalties: bool, device: jax.Device | None = None
) -> SamplingTable:
    """All ``num_seats + 1`` rows greedy with no history (the last row is the padding row)."""
    rows = num_seats + 1
    floats, ints, seed = params_to_rows(DeviceSamplingParams(temperature=0.0), 0)
    table = SamplingTable(
        floats=jnp.tile(jnp.asarray(floats), (rows, 1)),
        ints=jnp.tile(jnp.asarray(ints), (rows, 1)),
        seeds=jnp.tile(jnp.asarray(seed), (rows, 1)),
        output_counts=jnp.zeros((rows, vocab_size), jnp.int32) if enable_penalties else None,
        prompt_mask=jnp.zeros((rows, vocab_size), jnp.bool_) if enable_penalties else None,
        stop_mask=jnp.zeros((rows, vocab_size), jnp.bool_),
    )
    return jax.device_put(table, device) if device is not None else table


def write_seat(
    table: SamplingTable,
    seat: jax.Array,
    floats: jax.Array,
    ints: jax.Array,
    seed: jax.Array,
    prompt_ids: jax.Array,
    output_ids: jax.Array,
    stop_mask: jax.Array,
) -> SamplingTable:
    """Replace row ``seat``; token histories come as fixed-length id arrays padded with -1,
    the stop tokens as a ``bool [vocab]`` row (:func:`stop_mask_row`)."""
    new = table._replace(
        floats=table.floats.at[seat].set(floats),
        ints=table.ints.at[seat].set(ints),
        seeds=table.seeds.at[seat].set(seed),
        stop_mask=table.stop_mask.at[seat].set(stop_mask),
    )
    if table.output_counts is None or table.prompt_mask is None:
        return new
    vocab = table.output_counts.shape[1]
    prompt_ids = jnp.where(prompt_ids < 0, vocab, prompt_ids)
    output_ids = jnp.where(output_ids < 0, vocab, output_ids)
    mask = jnp.zeros((vocab,), jnp.bool_).at[prompt_ids].set(True, mode="drop")
    counts = jnp.zeros((vocab,), jnp.int32).at[output_ids].add(1, mode="drop")
    return new._replace(
        output_counts=table.output_counts.at[seat].set(counts),
        prompt_mask=table.prompt_mask.at[seat].set(mask),
    )


def gather_inputs(table: SamplingTable, rows: jax.Array) -> SamplingInputs:
    """The sampler inputs of the seats named by ``rows`` (one per sampled token)."""
    floats = table.floats[rows]
    ints = table.ints[rows]
    return SamplingInputs(
        temperature=floats[:, TEMPERATURE],
        top_k=ints[:, TOP_K],
        top_p=floats[:, TOP_P],
        min_p=floats[:, MIN_P],
        presence_penalty=floats[:, PRESENCE],
        frequency_penalty=floats[:, FREQUENCY],
        repetition_penalty=floats[:, REPETITION],
        seed=table.seeds[rows],
        has_seed=ints[:, HAS_SEED] != 0,
        step=ints[:, STEP],
        output_counts=None if table.output_counts is None else table.output_counts[rows],
        prompt_mask=None if table.prompt_mask is None else table.prompt_mask[rows],
        min_tokens=ints[:, MIN_TOKENS],
        stop_mask=table.stop_mask[rows],
        logprobs_mode=ints[:, LOGPROBS_MODE],
    )


def record_sampled(
    table: SamplingTable, rows: jax.Array, tokens: jax.Array, valid: jax.Array
) -> SamplingTable:
    """Count the tokens just sampled for ``rows`` (only where ``valid``) and advance steps."""
    ints = table.ints.at[rows, STEP].add(valid.astype(jnp.int32))
    if table.output_counts is None:
        return table._replace(ints=ints)
    vocab = table.output_counts.shape[1]
    counted = jnp.where(valid, tokens, vocab)
    counts = table.output_counts.at[rows, counted].add(1, mode="drop")
    return table._replace(ints=ints, output_counts=counts)


def seat_row(
    seat: int,
    params: DeviceSamplingParams,
    prompt_token_ids: Sequence[int] | np.ndarray,
    output_token_ids: Sequence[int] | np.ndarray,
    max_model_len: int,
    enable_penalties: bool,
    vocab_size: int,
) -> tuple[np.ndarray, ...]:
    """The host arrays :func:`write_seat` takes after the table: the seat, the float row,
    int row and seed of ``params``, the token histories padded to ``max_model_len`` with
    -1 (length 1 without penalties) and the stop-token row. ValueError when the histories
    exceed ``max_model_len``."""
    prompt = np.asarray(prompt_token_ids, np.int32).reshape(-1)
    output = np.asarray(output_token_ids, np.int32).reshape(-1)
    if len(prompt) + len(output) > max_model_len:
        raise ValueError(
            f"prompt + output ({len(prompt) + len(output)} tokens) exceed max_model_len "
            f"{max_model_len}"
        )
    ids_len = max_model_len if enable_penalties else 1
    prompt_buf = np.full(ids_len, -1, np.int32)
    output_buf = np.full(ids_len, -1, np.int32)
    if enable_penalties:
        prompt_buf[: len(prompt)] = prompt
        output_buf[: len(output)] = output
    floats, ints, seed = params_to_rows(params, len(output))
    return (
        np.asarray(seat, np.int32), floats, ints, seed, prompt_buf, output_buf,
        stop_mask_row(params, vocab_size),
    )
