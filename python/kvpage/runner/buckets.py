"""Padding sizes ("buckets") that bound how many shapes the jitted step is compiled for.

This file owns bucket lists and the choice of a bucket for a real size. A step with T
tokens and S sequences runs at the smallest token bucket >= T and sequence bucket >= S.

The policy (the one place it is stated):

* Token buckets are powers of two up to ``max_num_batched_tokens``, sequence buckets
  powers of two up to ``max_num_seqs``. They start at 1 on a CPU, where a step's cost
  follows its padded rows from the first row on (SmolLM2-135M's layers: 20 ms at 1 row,
  50 ms at 16), and at 16 tokens / 8 sequences on an accelerator, where a decode step
  costs the same up to a few dozen rows and each extra executable only costs compile
  time.
* Only the block-table *width* never makes a bucket: attention loops over the live KV
  (``pallas_kernels``), so ``max_model_len`` adds no executables and no work.
* A step padded to T tokens gets at least ``T / max_token_seq_ratio`` sequence rows,
  which bounds the (T, S) pairs; :meth:`ModelRunner.warmup_buckets` lists every pair a
  configuration can reach, i.e. the most executables it can ever compile
  (``ModelRunner.max_step_executables``). Executables compile on first use (or all at
  start-up with ``warmup``).
"""

from __future__ import annotations

from collections.abc import Sequence


def power_of_two_buckets(minimum: int, maximum: int) -> tuple[int, ...]:
    """``minimum, 2 * minimum, ...`` up to the first value >= ``maximum``."""
    if minimum <= 0 or maximum <= 0:
        raise ValueError(f"bucket bounds must be positive, got {minimum}, {maximum}")
    buckets = [minimum]
    while buckets[-1] < maximum:
        buckets.append(buckets[-1] * 2)
    return tuple(buckets)


def default_minimums(platform: str) -> tuple[int, int]:
    """Smallest (token, sequence) bucket for a device platform (see the module docstring)."""
    return (1, 1) if platform == "cpu" else (16, 8)


def normalize_buckets(buckets: Sequence[int], name: str) -> tuple[int, ...]:
    """Sorted, de-duplicated, validated bucket list."""
    result = tuple(sorted(set(int(b) for b in buckets)))
    if not result or result[0] <= 0:
        raise ValueError(f"{name} must be a non-empty list of positive ints, got {buckets!r}")
    return result


def pick_bucket(buckets: Sequence[int], size: int, name: str) -> int:
    """The smallest bucket >= ``size``; ValueError when ``size`` exceeds the largest."""
    for bucket in buckets:
        if bucket >= size:
            return bucket
    raise ValueError(f"{name} {size} exceeds the largest bucket {buckets[-1]}")
