"""Device sampler: masks, greedy, seeded reproducibility, penalties, logprobs, recompiles."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import model_fixtures  # noqa: F401  (sys.path / import setup, before kvpage)
import numpy as np
import pytest
from kvpage.sampling.sampler import (
    SamplingInputs,
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    sample,
)

N, V, K = 8, 64, 5
_TRACES = {"sample": 0}


def _sample_impl(logits: jax.Array, inputs: SamplingInputs, step_key_seed: jax.Array) -> Any:
    _TRACES["sample"] += 1  # runs once per trace, i.e. per compilation
    key = jax.random.fold_in(jax.random.key(0), step_key_seed)
    return sample(logits, inputs, key, K, True)


_sample = jax.jit(_sample_impl)
top_k_top_p = jax.jit(apply_top_k_top_p)
min_p_mask = jax.jit(apply_min_p)
penalties = jax.jit(apply_penalties)


def make_inputs(**overrides: Any) -> SamplingInputs:
    values: dict[str, Any] = dict(
        temperature=np.ones(N, np.float32),
        top_k=np.zeros(N, np.int32),
        top_p=np.ones(N, np.float32),
        min_p=np.zeros(N, np.float32),
        presence_penalty=np.zeros(N, np.float32),
        frequency_penalty=np.zeros(N, np.float32),
        repetition_penalty=np.ones(N, np.float32),
        seed=np.zeros((N, 2), np.uint32),
        has_seed=np.zeros(N, bool),
        step=np.zeros(N, np.int32),
        output_counts=np.zeros((N, V), np.int32),
        prompt_mask=np.zeros((N, V), bool),
        logprobs_mode=np.zeros(N, np.int32),
    )
    for name, value in overrides.items():
        value = np.asarray(value, values[name].dtype)
        if name == "seed" and value.shape[-1:] != (2,):
            value = np.stack([value, np.zeros_like(value)], axis=-1)
        values[name] = np.broadcast_to(value, values[name].shape).copy()
    return SamplingInputs(**values)


def run(logits: np.ndarray, inputs: SamplingInputs, step: int = 0) -> Any:
    return jax.device_get(_sample(jnp.asarray(logits, jnp.float32), inputs, jnp.int32(step)))


def random_logits(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(0, 2.0, (N, V)).astype(np.float32)


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def test_greedy_is_argmax() -> None:
    logits = random_logits(1)
    out = run(logits, make_inputs(temperature=0.0))
    np.testing.assert_array_equal(out.token_ids, logits.argmax(-1))


def test_greedy_rows_unaffected_by_random_rows() -> None:
    logits = random_logits(2)
    temps = np.array([0, 1, 0, 0.7, 0, 1.3, 0, 0], np.float32)
    out = run(logits, make_inputs(temperature=temps, top_k=3))
    greedy = temps == 0
    np.testing.assert_array_equal(out.token_ids[greedy], logits.argmax(-1)[greedy])


def test_top_k_mask_keeps_k_largest() -> None:
    logits = random_logits(3)
    k = np.array([1, 2, 3, 5, 10, 0, -1, V], np.int32)
    masked = np.asarray(top_k_top_p(jnp.asarray(logits), jnp.asarray(k), jnp.ones(N)))
    for row in range(N):
        kept = np.flatnonzero(np.isfinite(masked[row]))
        want = V if k[row] <= 0 or k[row] >= V else k[row]
        np.testing.assert_array_equal(np.sort(kept), np.sort(np.argsort(-logits[row])[:want]))
        np.testing.assert_array_equal(masked[row, kept], logits[row, kept])


def test_top_p_keeps_smallest_nucleus() -> None:
    probs = np.array([0.5, 0.3, 0.15, 0.05], np.float32)
    logits = np.tile(np.log(probs), (3, 1))
    top_p = jnp.asarray([0.45, 0.75, 0.85])
    masked = np.asarray(
        top_k_top_p(jnp.asarray(logits), jnp.zeros(3, jnp.int32), top_p)
    )
    kept = [np.flatnonzero(np.isfinite(row)).tolist() for row in masked]
    assert kept == [[0], [0, 1], [0, 1, 2]]


def test_top_k_then_top_p() -> None:
    probs = np.array([0.4, 0.3, 0.2, 0.1], np.float32)
    logits = np.log(probs)[None, :]
    # Among the top 2 (renormalised 0.571, 0.429), top_p 0.5 keeps only the first.
    for top_p, want in ((0.5, [0]), (0.9, [0, 1])):
        masked = np.asarray(
            top_k_top_p(jnp.asarray(logits), jnp.asarray([2]), jnp.asarray([top_p]))
        )
        assert np.flatnonzero(np.isfinite(masked[0])).tolist() == want


def test_min_p_mask() -> None:
    probs = np.array([0.5, 0.3, 0.15, 0.05], np.float32)
    logits = np.tile(np.log(probs), (3, 1))
    masked = np.asarray(min_p_mask(jnp.asarray(logits), jnp.asarray([0.0, 0.2, 0.5])))
    kept = [np.flatnonzero(np.isfinite(row)).tolist() for row in masked]
    assert kept == [[0, 1, 2, 3], [0, 1, 2], [0, 1]]


def test_samples_stay_inside_top_k_and_follow_distribution() -> None:
    logits = np.tile(np.log(np.array([0.4, 0.3, 0.2, 0.1] + [1e-3] * (V - 4))), (N, 1))
    inputs = make_inputs(top_k=3, seed=np.arange(N), has_seed=True)
    counts = np.zeros(V)
    for step in range(60):
        inputs = inputs._replace(step=np.full(N, step, np.int32))
        counts += np.bincount(run(logits, inputs).token_ids, minlength=V)
    assert counts[3:].sum() == 0
    freq = counts[:3] / counts.sum()
    np.testing.assert_allclose(freq, np.array([4, 3, 2]) / 9, atol=0.07)


def test_seeded_row_independent_of_batch_composition() -> None:
    logits_a = random_logits(4)
    logits_b = random_logits(5)
    row = logits_a[0].copy()
    logits_b[5] = row
    seeded = dict(temperature=1.0, top_k=0, top_p=0.9, seed=1234, has_seed=True, step=7)

    def inputs_with(position: int, others: dict[str, Any]) -> SamplingInputs:
        base = make_inputs(**others)
        fields = base._asdict()
        for name, value in seeded.items():
            fields[name] = fields[name].copy()
            fields[name][position] = value
        return SamplingInputs(**fields)

    a = run(logits_a, inputs_with(0, dict(temperature=0.5)), step=1)
    b = run(logits_b, inputs_with(5, dict(temperature=0.0, top_k=2)), step=99)
    assert a.token_ids[0] == b.token_ids[5]
    # The token depends on the step index: over several steps the draws differ.
    draws = set()
    for step in range(8):
        seeded["step"] = step
        draws.add(int(run(logits_a, inputs_with(0, {})).token_ids[0]))
    assert len(draws) > 1


def test_penalties_follow_vllm_semantics() -> None:
    logits = random_logits(6)
    counts = np.random.default_rng(7).integers(0, 3, (N, V)).astype(np.int32)
    prompt = np.random.default_rng(8).random((N, V)) < 0.2
    presence = np.linspace(-1, 1, N).astype(np.float32)
    frequency = np.linspace(0.5, -0.5, N).astype(np.float32)
    repetition = np.linspace(0.8, 1.6, N).astype(np.float32)
    got = np.asarray(
        penalties(
            jnp.asarray(logits), jnp.asarray(counts), jnp.asarray(prompt),
            jnp.asarray(presence), jnp.asarray(frequency), jnp.asarray(repetition),
        )
    )
    want = logits.copy()
    seen = (counts > 0) | prompt
    rep = np.broadcast_to(repetition[:, None], want.shape)
    want = np.where(seen & (want > 0), want / rep, np.where(seen, want * rep, want))
    want = want - frequency[:, None] * counts - presence[:, None] * (counts > 0)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_greedy_with_repetition_penalty_avoids_seen_token() -> None:
    logits = np.zeros((N, V), np.float32)
    logits[:, 3] = 2.0
    logits[:, 4] = 1.5
    prompt = np.zeros((N, V), bool)
    prompt[:, 3] = True
    out = run(logits, make_inputs(temperature=0.0, repetition_penalty=2.0, prompt_mask=prompt))
    assert (out.token_ids == 4).all()
    counts = np.zeros((N, V), np.int32)
    counts[:, 3] = 1
    out = run(logits, make_inputs(temperature=0.0, presence_penalty=0.6, output_counts=counts))
    assert (out.token_ids == 4).all()
    out = run(logits, make_inputs(temperature=0.0, presence_penalty=0.4, output_counts=counts))
    assert (out.token_ids == 3).all()


def test_logprobs_are_raw_log_softmax() -> None:
    logits = random_logits(9)
    out = run(logits, make_inputs(temperature=0.8, top_k=4, repetition_penalty=1.3))
    expected = log_softmax(logits)
    rows = np.arange(N)
    np.testing.assert_allclose(out.logprobs, expected[rows, out.token_ids], atol=1e-5)
    ranks = 1 + (expected > expected[rows, out.token_ids][:, None]).sum(-1)
    np.testing.assert_array_equal(out.ranks, ranks)
    np.testing.assert_array_equal(out.top_token_ids, np.argsort(-expected, -1)[:, :K])
    np.testing.assert_allclose(out.top_logprobs, np.sort(expected, -1)[:, ::-1][:, :K], atol=1e-5)


def test_logprobs_mode_reports_raw_or_processed_values() -> None:
    """Per row: raw log-softmax, raw logits, or the log-softmax / logits the token was
    drawn from (temperature and top-k applied; greedy rows: the logits themselves)."""
    logits = random_logits(11)
    modes = np.array([0, 1, 2, 3, 0, 1, 2, 3])
    temperature = np.array([0.7, 0.7, 0.7, 0.7, 0.0, 0.0, 0.0, 0.0], np.float32)
    top_k = np.array([0, 8, 8, 8, 0, 0, 0, 0])
    out = run(logits, make_inputs(temperature=temperature, top_k=top_k, logprobs_mode=modes))
    for row in range(N):
        raw = logits[row].astype(np.float64)
        processed = raw / temperature[row] if temperature[row] > 0 else raw.copy()
        if top_k[row]:
            processed[raw < np.sort(raw)[-top_k[row]]] = -np.inf
        expected = [log_softmax(raw), raw, log_softmax(processed), processed][modes[row]]
        token = out.token_ids[row]
        assert np.isfinite(processed[token])  # drawn from the processed distribution
        np.testing.assert_allclose(out.logprobs[row], expected[token], rtol=1e-5, atol=1e-5)
        assert out.ranks[row] == 1 + (expected > expected[token]).sum()
        np.testing.assert_allclose(
            out.top_logprobs[row], np.sort(expected)[::-1][:K], rtol=1e-5, atol=1e-5
        )


def test_all_raw_rows_report_what_they_did_before_the_modes() -> None:
    logits = random_logits(12)
    inputs = make_inputs(temperature=0.8, top_k=4)
    with_modes = run(logits, inputs)
    without = run(logits, inputs._replace(logprobs_mode=None))
    for name in ("token_ids", "logprobs", "ranks", "top_token_ids", "top_logprobs"):
        np.testing.assert_array_equal(getattr(with_modes, name), getattr(without, name))


@pytest.mark.parametrize("variant", range(4))
def test_changing_parameters_does_not_retrace(variant: int) -> None:
    run(random_logits(0), make_inputs())
    before = _TRACES["sample"]
    params = [
        dict(temperature=0.0),
        dict(temperature=0.3, top_k=7, top_p=0.5, min_p=0.1),
        dict(seed=np.arange(N), has_seed=True, presence_penalty=0.5, frequency_penalty=-0.2),
        dict(repetition_penalty=1.7, step=np.arange(N) * 3),
    ][variant]
    run(random_logits(variant), make_inputs(**params), step=variant)
    assert _TRACES["sample"] == before


def _top_k_top_p_by_sorting(logits: np.ndarray, top_k: np.ndarray, top_p: np.ndarray) -> np.ndarray:
    """The definition, written with a sort: which tokens survive in each row."""
    keep = np.zeros(logits.shape, bool)
    vocab = logits.shape[-1]
    for r, row in enumerate(logits):
        ordered = np.sort(row)[::-1]
        k = vocab if top_k[r] <= 0 or top_k[r] >= vocab else top_k[r]
        survivors = row >= ordered[k - 1]
        if top_p[r] < 1.0:
            z = np.where(survivors, row, -np.inf).astype(np.float64)
            probs = np.exp(z - z.max())
            probs /= probs.sum()
            # smallest value whose strictly-greater tokens hold less than top_p
            kept = [v for v in np.unique(row[survivors]) if probs[row > v].sum() < top_p[r]]
            survivors &= row >= min(kept)
        keep[r] = survivors & np.isfinite(row)
    return keep


@pytest.mark.parametrize("seed", range(12))
def test_top_k_top_p_without_sorting_matches_the_definition(seed: int) -> None:
    from kvpage.sampling.sampler import apply_top_k_top_p

    rng = np.random.default_rng(seed)
    rows, vocab = 6, int(rng.integers(2, 400))
    logits = (rng.standard_normal((rows, vocab)) * rng.uniform(0.2, 8)).astype(np.float32)
    if seed % 2:
        logits = np.round(logits)  # many ties, and both -0.0 and 0.0
    logits[0, :] = -np.inf
    logits[0, seed % vocab] = 1.0  # one finite token
    top_k = rng.integers(-1, vocab + 2, rows).astype(np.int32)
    top_p = rng.uniform(0.05, 1.1, rows).astype(np.float32)
    out = np.asarray(apply_top_k_top_p(jnp.asarray(logits), jnp.asarray(top_k), jnp.asarray(top_p)))
    np.testing.assert_array_equal(np.isfinite(out), _top_k_top_p_by_sorting(logits, top_k, top_p))
    assert np.isfinite(out).any(axis=-1).all()  # the most likely token always survives
