"""Synthetic workloads: prompt/output length distributions and arrivals.

Used by the simulator and the benchmarks. All draws come from one seeded
``numpy.random.Generator`` so runs replay exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

DISTRIBUTIONS = ("fixed", "uniform", "sharegpt")


@dataclass(slots=True)
class SyntheticRequest:
    """One request of a workload: when it arrives and what it asks for."""

    arrival: float
    prompt_token_ids: list[int]
    output_len: int


def sample_lengths(
    dist: str, n: int, mean: int, rng: np.random.Generator, range_ratio: float = 0.0
) -> np.ndarray:
    """``n`` lengths >= 1 with the given mean.

    ``fixed``: all equal to ``mean``; ``uniform``: in mean * [1 - r, 1 + r];
    ``sharegpt``: long-tailed (lognormal, sigma 0.9) like real chat traffic,
    capped at 8x the mean.
    """
    if dist == "fixed":
        return np.full(n, max(mean, 1), dtype=np.int64)
    if dist == "uniform":
        low = max(int(mean * (1 - range_ratio)), 1)
        high = max(int(mean * (1 + range_ratio)), low)
        return rng.integers(low, high + 1, size=n)
    if dist == "sharegpt":
        sigma = 0.9
        mu = np.log(mean) - sigma**2 / 2
        lengths = rng.lognormal(mu, sigma, size=n)
        return np.clip(np.round(lengths), 1, 8 * mean).astype(np.int64)
    raise ValueError(f"length distribution must be one of {DISTRIBUTIONS}, got {dist!r}")


def make_workload(
    num_requests: int,
    *,
    input_len: int = 230,
    output_len: int = 200,
    dist: str = "sharegpt",
    range_ratio: float = 0.0,
    shared_prefix_len: int = 0,
    request_rate: float = float("inf"),
    vocab_size: int = 32000,
    seed: int = 0,
    output_lens: list[int] | None = None,
) -> list[SyntheticRequest]:
    """Requests with Poisson arrivals at ``request_rate`` per unit time
    (``inf``: all at time 0). ``shared_prefix_len`` tokens open every prompt
    (a common system prompt). ``output_lens`` overrides the output draw."""
    rng = np.random.default_rng(seed)
    prompt_lens = sample_lengths(dist, num_requests, input_len, rng, range_ratio)
    if output_lens is None:
        outs = sample_lengths(dist, num_requests, output_len, rng, range_ratio)
    else:
        if len(output_lens) != num_requests:
            raise ValueError(
                f"output_lens has {len(output_lens)} entries for {num_requests} requests"
            )
        outs = np.asarray(output_lens, dtype=np.int64)
    if np.isinf(request_rate):
        arrivals = np.zeros(num_requests)
    else:
        if request_rate <= 0:
            raise ValueError(f"request_rate must be > 0 or inf, got {request_rate}")
        arrivals = np.cumsum(rng.exponential(1.0 / request_rate, size=num_requests))
    prefix = rng.integers(3, vocab_size, size=shared_prefix_len).tolist()
    requests = []
    for arrival, plen, olen in zip(arrivals, prompt_lens, outs, strict=True):
        body = rng.integers(3, vocab_size, size=int(plen)).tolist()
        requests.append(SyntheticRequest(float(arrival), prefix + body, int(olen)))
    return requests
