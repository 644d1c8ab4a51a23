"""Padding sizes ("buckets") that bound how many shapes the jitted step is compiled for.

This file owns bucket lists and the choice of a bucket for a real size. A step with T
tokens and S sequences runs at the smallest token bucket >= T and sequence bucket >= S.
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
