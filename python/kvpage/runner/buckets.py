"""Padding sizes ("buckets") that bound how many shapes the jitted step is compiled for.

This file owns bucket lists and the choice of a bucket for a real size. A step with T
tokens and S sequences runs at the smallest token bucket >= T and sequence bucket >= S.

The policy (the one place it is stated):

* Token buckets are powers of two up to ``max_num_batched_tokens``, sequence buckets
  powers of two up to ``max_num_seqs``. They start at 1 on a CPU, where a step's cost
  follows its padded rows (SmolLM2-135M, whole decode steps: 22 ms at 1 row, 46 at 4,
  71 at 16, 173 at 64, 566 at 256; ``benches/bucket_curve.py``), but skip 2
  (:data:`CPU_SKIPPED_BUCKETS`: 2 rows cost 43 ms, within 7 % of 4); and at 16 tokens /
  8 sequences on an accelerator, where a decode step costs the same up to a few dozen
  rows and each extra executable only costs compile time.
* On a CPU, token buckets from :data:`CPU_HALF_STEPS_FROM` up also get the size half-way
  to the next power of two (768, 1536, ...): a prompt chunk of 1100 tokens pads to 1536
  rows, not 2048, and a CPU pays for every padded row. 64 ShareGPT-like requests at
  concurrency 32 on SmolLM2 Q4_1 (``engine.step()``, both grids in one process taking
  turns, 2026-11-26): 145.4 s with powers of two, 140.2 s with 384, 768 and 1536 added
  (3.6 % less), the same tokens; SmolLM2 then has 43 step executables instead of 38.
* Only the block-table *width* never makes a bucket: attention loops over the live KV
  (``kvpage.kernels``), so ``max_model_len`` adds no executables and no work.
* A step padded to T tokens gets at least ``T / max_token_seq_ratio`` sequence rows,
  which bounds the (T, S) pairs; :meth:`ModelRunner.warmup_buckets` lists every pair a
  configuration can reach (``ModelRunner.max_step_executables``; 43 for SmolLM2 at the
  defaults).
* What a bucket costs to compile (issue #25): its embed, ONE group of three decoder
  layers (called once per group) and its select piece; the head (lm_head + sampler) is
  keyed by S alone and shared by every T (:mod:`kvpage.runner.layered_step`). SmolLM2 on
  this 2-core CPU, empty cache: a bucket took 4.5-4.8 s when the step traced all 30
  layers; now 1.3-1.5 s, plus ~0.8 s for a head the first time an S is used
  (``benches/bucket_curve.py``); from the persistent cache, tens of ms. Against the step
  curve above, a decode bucket pays back its compile within 10-300 steps of the next
  bucket up (2 rows aside), so the grid stays fine-grained, and what is never used is
  never compiled.
* When they compile: on first use (``warmup="none"``, ``kvpage generate`` and ``LLM``),
  all at start-up (``"full"``), or on a background thread while requests already run
  (``"background"``, ``kvpage serve``): pure-decode buckets first, smallest first, then
  the mixed ones (:func:`background_order`). A step whose bucket is not compiled yet runs
  in the smallest compiled one with at most :data:`FALLBACK_MAX_RATIO` times its padded
  tokens (:func:`pick_fallback`), and its own bucket is compiled next; with none that
  close it compiles its own on the spot. A request never waits for a bucket it does not
  need.
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


CPU_SKIPPED_BUCKETS = frozenset({2})
"""Sizes a CPU never compiles: a 2-row step costs within 7 % of a 4-row one (SmolLM2,
XLA's dot: 43.0 vs 46.0 ms; the host small-batch matmul streams the weights once for 2-32
rows alike), so a 2-row bucket would pay back its ~2 s compile only after ~650 steps."""


CPU_HALF_STEPS_FROM = 512
"""The smallest power-of-two token bucket a CPU adds a half step after (module docs)."""


def default_buckets(platform: str, maximum: int, kind: str) -> tuple[int, ...]:
    """The default token (``kind="tokens"``) or sequence bucket list up to ``maximum``."""
    minimum = default_minimums(platform)[0 if kind == "tokens" else 1]
    buckets = power_of_two_buckets(min(minimum, maximum), maximum)
    if platform == "cpu":  # never the largest: it bounds every step
        buckets = tuple(b for b in buckets[:-1] if b not in CPU_SKIPPED_BUCKETS) + buckets[-1:]
        if kind == "tokens":
            halves = {b * 3 // 2 for b in buckets if b >= CPU_HALF_STEPS_FROM}
            buckets = tuple(sorted(set(buckets) | {h for h in halves if h < buckets[-1]}))
    return buckets


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


FALLBACK_MAX_RATIO = 4
"""While its own bucket compiles in the background, a step may run in a compiled bucket
with at most this many times its padded tokens (a step's cost follows its padded rows on
a CPU); with none that close, it compiles its own bucket on the spot."""

StepKey = tuple[int, int, bool]


def pick_fallback(key: StepKey, compiled: Sequence[StepKey]) -> StepKey | None:
    """The smallest compiled bucket that can run a step of bucket ``key``: at least its
    tokens and sequences, at most :data:`FALLBACK_MAX_RATIO` times its tokens, and the
    same variant -- except that a mixed bucket also runs a pure-decode step."""
    tokens, seqs, decode_only = key
    fits = [
        k
        for k in compiled
        if k[0] >= tokens
        and k[1] >= seqs
        and k[0] <= FALLBACK_MAX_RATIO * tokens
        and (k[2] == decode_only or not k[2])
    ]
    return min(fits, key=lambda k: (k[0], k[1], not k[2])) if fits else None


def background_order(keys: Sequence[StepKey]) -> list[StepKey]:
    """The order the background compiler builds buckets in: pure-decode buckets first,
    smallest first (every request decodes, most at small batch), then mixed (prefill)
    buckets, smallest first."""
    return sorted(keys, key=lambda k: (not k[2], k[0], k[1]))
