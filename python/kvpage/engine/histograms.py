"""The histograms of the engine's metrics: their buckets, and
:class:`BatchedHistogram` for a series observed many times a step."""

from __future__ import annotations

import bisect
import itertools
import math
import threading
import time
from collections.abc import Mapping, Sequence

import numpy as np
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

FAST_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0,
)
TOKEN_GAP_BUCKETS = (
    0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.0, 2.0, 5.0,
)
REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0)
STEP_TOKEN_BUCKETS = tuple(float(1 << i) for i in range(15))  # 1 .. 16384
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0)  # vLLM's
N_BUCKETS = (1.0, 2.0, 5.0, 10.0, 20.0)


def buckets_1_2_5(limit: int) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's token-count buckets)."""
    out: list[float] = []
    magnitude = 1
    while True:
        for m in (1, 2, 5):
            value = m * magnitude
            if value > limit:
                return tuple(out) or (1.0,)
            out.append(float(value))
        magnitude *= 10


class BatchedHistogram:
    """A histogram of one label set, exposed as prometheus_client's ``Histogram`` is
    (buckets, count, sum, created), whose running counts are kept here so that many
    amounts are counted in one pass (:meth:`observe_many`): a step's inter-token
    latencies, one per streaming request, would cost ~0.75 us each through
    ``Histogram.observe``'s bucket scan and locks, as much as the rest of the engine's
    host work per sequence."""

    def __init__(
        self, name: str, documentation: str, labels: Mapping[str, str],
        buckets: Sequence[float], registry: CollectorRegistry,
    ) -> None:
        self._name, self._documentation = name, documentation
        self._labels = dict(labels)
        bounds = [float(b) for b in buckets]
        if bounds[-1] != math.inf:
            bounds.append(math.inf)
        self._bounds = bounds
        self._bounds_array = np.asarray(bounds, np.float64)
        self._le = [floatToGoString(b) for b in bounds]
        self._counts = [0] * len(bounds)  # per bucket, not cumulative
        self._sum = 0.0
        self._created = time.time()
        self._lock = threading.Lock()  # updates (engine thread) against scrapes
        registry.register(self)

    def observe(self, amount: float) -> None:
        """Count ``amount`` in the first bucket whose bound is >= it (NaN: in none)."""
        with self._lock:
            self._sum += amount
            if amount == amount:
                self._counts[bisect.bisect_left(self._bounds, amount)] += 1

    def observe_many(self, amounts: Sequence[float]) -> None:
        """``observe(a)`` for every ``a`` in ``amounts``, as one update per bucket."""
        if len(amounts) < 8:
            for amount in amounts:
                self.observe(amount)
            return
        values = np.asarray(amounts, np.float64)
        bounds = self._bounds_array
        # NaN sorts past the last bound: counted in no bucket, as observe() does
        counts = np.bincount(np.searchsorted(bounds, values, side="left"),
                             minlength=len(bounds) + 1)[: len(bounds)].tolist()
        total = float(values.sum())
        with self._lock:
            self._sum += total
            for i, count in enumerate(counts):
                if count:
                    self._counts[i] += count

    def collect(self) -> list[Metric]:
        """The series, for the registry (any thread)."""
        with self._lock:
            counts, total = list(self._counts), self._sum
        family = HistogramMetricFamily(self._name, self._documentation,
                                       labels=list(self._labels))
        cumulative = [float(c) for c in itertools.accumulate(counts)]
        family.add_metric(list(self._labels.values()),
                          list(zip(self._le, cumulative, strict=True)), sum_value=total)
        family.add_sample(self._name + "_created", self._labels, self._created)
        return [family]
