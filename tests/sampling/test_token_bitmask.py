"""Grammar bitmasks in the device sampler: the packed format, masking before
temperature / top-k / top-p, the EOS-only row under min_tokens, and all-ones rows
changing nothing."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kvpage.sampling.sampler import SamplingInputs, sample
from kvpage.sampling.token_bitmask import allowed_tokens, bitmask_words, pad_bitmask

N, V = 6, 70  # V not a multiple of 32: the last word is partial
EOS = 69


def pack(allowed: np.ndarray) -> np.ndarray:
    """bool [N, V] -> int32 [N, ceil(V / 32)] (bit t % 32 of word t // 32)."""
    words = bitmask_words(allowed.shape[1])
    padded = np.zeros((allowed.shape[0], words * 32), bool)
    padded[:, : allowed.shape[1]] = allowed
    bits = padded.reshape(allowed.shape[0], words, 32).astype(np.uint64)
    return (bits << np.arange(32, dtype=np.uint64)).sum(-1).astype(np.uint32).view(np.int32)


def inputs(**overrides: Any) -> SamplingInputs:
    values: dict[str, Any] = dict(
        temperature=np.ones(N, np.float32), top_k=np.zeros(N, np.int32),
        top_p=np.ones(N, np.float32), min_p=np.zeros(N, np.float32),
        presence_penalty=np.zeros(N, np.float32), frequency_penalty=np.zeros(N, np.float32),
        repetition_penalty=np.ones(N, np.float32), seed=np.zeros((N, 2), np.uint32),
        has_seed=np.zeros(N, bool), step=np.zeros(N, np.int32), output_counts=None,
        prompt_mask=None, min_tokens=np.zeros(N, np.int32), stop_mask=np.zeros((N, V), bool),
    )
    for name, value in overrides.items():
        values[name] = np.broadcast_to(np.asarray(value, values[name].dtype),
                                       values[name].shape).copy()
    return SamplingInputs(**values)


@jax.jit
def _sample(logits: jax.Array, inp: SamplingInputs, bitmask: jax.Array, step: jax.Array) -> Any:
    return sample(logits, inp, jax.random.fold_in(jax.random.key(1), step), 0, False, bitmask)


def run(logits: np.ndarray, inp: SamplingInputs, bitmask: np.ndarray, step: int = 0) -> Any:
    return jax.device_get(_sample(jnp.asarray(logits), inp, jnp.asarray(bitmask), step))


def test_packed_bits_round_trip_including_bit_31() -> None:
    rng = np.random.default_rng(0)
    allowed = rng.random((N, V)) < 0.5
    allowed[:, 31] = True  # the sign bit of word 0
    allowed[0, :] = False
    got = np.asarray(allowed_tokens(jnp.asarray(pack(allowed)), V))
    np.testing.assert_array_equal(got, allowed)


def test_every_draw_stays_inside_the_mask_before_temperature_top_k_top_p() -> None:
    rng = np.random.default_rng(1)
    logits = rng.normal(0, 3, (N, V)).astype(np.float32)
    allowed = rng.random((N, V)) < 0.1
    allowed[np.arange(N), rng.integers(0, V, N)] = True
    mask = pack(allowed)
    best_allowed = np.where(allowed, logits, -np.inf).argmax(-1)
    greedy = run(logits, inputs(temperature=0.0), mask)
    np.testing.assert_array_equal(greedy.token_ids, best_allowed)
    top1 = run(logits, inputs(temperature=2.0, top_k=1), mask)  # top-k after the mask
    np.testing.assert_array_equal(top1.token_ids, best_allowed)
    for step in range(30):
        out = run(logits, inputs(temperature=1.5, top_p=0.9, min_p=0.01), mask, step)
        assert allowed[np.arange(N), out.token_ids].all()


def test_eos_only_row_wins_over_min_tokens() -> None:
    logits = np.random.default_rng(2).normal(0, 1, (N, V)).astype(np.float32)
    allowed = np.zeros((N, V), bool)
    allowed[:, EOS] = True  # the grammar is complete
    stop = np.zeros((N, V), bool)
    stop[:, EOS] = True
    out = run(logits, inputs(temperature=1.0, min_tokens=5, stop_mask=stop), pack(allowed))
    np.testing.assert_array_equal(out.token_ids, EOS)


def test_all_ones_rows_change_nothing() -> None:
    logits = np.random.default_rng(3).normal(0, 2, (N, V)).astype(np.float32)
    all_ones = np.full((N, bitmask_words(V)), -1, np.int32)
    for step in range(5):
        with_mask = run(logits, inputs(), all_ones, step)
        plain = jax.device_get(jax.jit(
            lambda x, i, s: sample(x, i, jax.random.fold_in(jax.random.key(1), s), 0, False)
        )(jnp.asarray(logits), inputs(), step))
        np.testing.assert_array_equal(with_mask.token_ids, plain.token_ids)


def test_pad_bitmask_checks_its_shape() -> None:
    mask = pack(np.ones((2, V), bool))
    padded = pad_bitmask(mask, 4, V)
    assert padded.shape == (4, 3) and (padded[2:] == -1).all()
    with pytest.raises(ValueError, match="token_bitmask"):
        pad_bitmask(mask[:, :2], 4, V)
