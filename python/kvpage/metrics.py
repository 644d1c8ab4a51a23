"""Serving metrics: Prometheus series and the periodic engine stats log line.

This file owns the metric definitions (vLLM's metric names under a ``kvpage:``
prefix, each labelled with ``model_name``) on one private
``CollectorRegistry`` per ``EngineMetrics`` (no process-global state), their
update from ``LLMEngine.get_stats()`` after every step and from the
``RequestOutput``s each step produces, and a throughput log line written
every few seconds while the engine is busy.

Update methods are called from the engine thread only; ``render`` may be
called from any thread (prometheus_client guards its values with locks).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from kvpage.outputs import RequestOutput

PREFIX = "kvpage:"

_FAST_LATENCY_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 25.0, 60.0,
)
_TOKEN_GAP_BUCKETS = (
    0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1.0, 2.0, 5.0,
)
_REQUEST_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_STEP_TOKEN_BUCKETS = tuple(float(1 << i) for i in range(15))  # 1 .. 16384

_CUMULATIVE_STATS = {
    # metric attribute -> get_stats() key of a running total
    "prefix_cache_queries": "prefix_cache_query_tokens",
    "prefix_cache_hits": "prefix_cache_hit_tokens",
    "num_preemptions": "num_preemptions",
    "prompt_tokens": "prompt_tokens_total",
    "generation_tokens": "generation_tokens_total",
}

logger = logging.getLogger("kvpage.metrics")


@dataclass(slots=True)
class _Seen:
    """What was already observed for one live request."""

    first_token: bool = False
    queued: bool = False
    last_token_time: float | None = None


def request_finish_reason(output: RequestOutput) -> str:
    """One finish reason for a whole request (its samples may differ):
    "error" or "abort" if any sample ended that way, else the first sample's."""
    reasons = [c.finish_reason for c in output.outputs if c.finish_reason is not None]
    if output.error is not None or "error" in reasons:
        return "error"
    if "abort" in reasons or not reasons:
        return "abort"
    return reasons[0]


class EngineMetrics:
    """The engine's Prometheus metrics and stats log line.

    ``log_interval_s=None`` turns the log line off.
    """

    def __init__(
        self,
        model_name: str = "kvpage",
        *,
        registry: CollectorRegistry | None = None,
        log_interval_s: float | None = 5.0,
        log: logging.Logger | None = None,
    ) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.log_interval_s = log_interval_s
        self._log = log or logger
        reg, label = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Any:
            return Gauge(PREFIX + name, doc, label, registry=reg).labels(model_name)

        def counter(name: str, doc: str) -> Any:
            return Counter(PREFIX + name, doc, label, registry=reg).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(PREFIX + name, doc, label, registry=reg,
                             buckets=buckets).labels(model_name)

        self.num_requests_running = gauge("num_requests_running",
                                          "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting",
                                          "Requests queued, waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge(
            "kv_cache_usage_perc", "Fraction of KV cache blocks in use (1.0 = full).")
        self.prefix_cache_queries = counter(
            "prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter(
            "prefix_cache_hits_total", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions_total",
                                       "Sequences preempted to free KV blocks.")
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens received.")
        self.generation_tokens = counter("generation_tokens_total", "Tokens generated.")
        self._request_success = Counter(
            PREFIX + "request_success_total", "Finished requests, by finish reason.",
            ["model_name", "finished_reason"], registry=reg,
        )
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds", "Arrival to first generated token.",
            _FAST_LATENCY_BUCKETS)
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds", "Time between successive tokens of a request.",
            _TOKEN_GAP_BUCKETS)
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to finish of a request.", _REQUEST_BUCKETS)
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled step.",
            _FAST_LATENCY_BUCKETS)
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens processed by one engine step.",
            _STEP_TOKEN_BUCKETS)

        self._last_totals: dict[str, float] = {}
        self._live: dict[str, _Seen] = {}
        self._log_time = time.monotonic()
        self._log_totals: dict[str, float] = {}

    # ---- updates (engine thread) ----------------------------------------

    def request_success(self, finished_reason: str) -> Any:
        """The ``request_success_total`` child for one finish reason."""
        return self._request_success.labels(self.model_name, finished_reason)

    def on_step(self, stats: Mapping[str, Any], outputs: Iterable[RequestOutput] = (),
                *, ran: bool = True) -> None:
        """Update from ``get_stats()`` after a step (``ran``: it ran a plan)
        and from the outputs that step returned."""
        self.num_requests_running.set(stats.get("num_requests_running", 0))
        self.num_requests_waiting.set(stats.get("num_requests_waiting", 0))
        self.kv_cache_usage_perc.set(stats.get("kv_cache_usage_perc", 0.0))
        for attr, key in _CUMULATIVE_STATS.items():
            if key not in stats:
                continue
            value = float(stats[key])
            previous = self._last_totals.get(key, 0.0)
            # a running total that went down was reset: count from the new base
            delta = value - previous if value >= previous else value
            if delta > 0:
                getattr(self, attr).inc(delta)
            self._last_totals[key] = value
        step_tokens = stats.get("last_step_tokens", 0)
        if ran and step_tokens:
            self.iteration_tokens.observe(step_tokens)
        self.on_outputs(outputs)

    def on_outputs(self, outputs: Iterable[RequestOutput],
                   finished_reason: str | None = None) -> None:
        """Latency histograms and finish counts from request outputs;
        ``finished_reason`` overrides the reason of finished ones."""
        for out in outputs:
            seen = self._live.get(out.request_id)
            if seen is None:
                seen = self._live[out.request_id] = _Seen()
            m = out.metrics
            if not seen.queued and m.queue_time is not None:
                seen.queued = True
                self.request_queue_time.observe(max(0.0, m.queue_time))
            if not seen.first_token and m.time_to_first_token is not None:
                seen.first_token = True
                self.time_to_first_token.observe(max(0.0, m.time_to_first_token))
            if m.last_token_time is not None and any(c.token_ids for c in out.outputs):
                if seen.last_token_time is not None and m.last_token_time > seen.last_token_time:
                    self.inter_token_latency.observe(m.last_token_time - seen.last_token_time)
                seen.last_token_time = m.last_token_time
            if out.finished:
                self._live.pop(out.request_id, None)
                self.request_success(finished_reason or request_finish_reason(out)).inc()
                end = m.finished_time if m.finished_time is not None else time.monotonic()
                self.e2e_request_latency.observe(max(0.0, end - m.arrival_time))

    def forget(self, request_id: str, finished_reason: str | None = None) -> None:
        """A request ended without a finished output (e.g. a failed step)."""
        self._live.pop(request_id, None)
        if finished_reason is not None:
            self.request_success(finished_reason).inc()

    def maybe_log(self, stats: Mapping[str, Any], now: float | None = None) -> str | None:
        """Log (and return) the stats line when ``log_interval_s`` has passed."""
        if self.log_interval_s is None:
            return None
        now = time.monotonic() if now is None else now
        elapsed = now - self._log_time
        if elapsed < self.log_interval_s:
            return None
        keys = ("prompt_tokens_total", "generation_tokens_total", "prefix_cache_query_tokens",
                "prefix_cache_hit_tokens")
        totals = {k: float(stats.get(k, 0)) for k in keys}
        delta = {k: max(0.0, totals[k] - self._log_totals.get(k, 0.0)) for k in keys}
        self._log_time, self._log_totals = now, totals
        queries = delta["prefix_cache_query_tokens"]
        hit_rate = 100.0 * delta["prefix_cache_hit_tokens"] / queries if queries else 0.0
        line = (
            f"Engine: prompt throughput {delta['prompt_tokens_total'] / elapsed:.1f} tokens/s, "
            f"generation throughput {delta['generation_tokens_total'] / elapsed:.1f} tokens/s, "
            f"Running: {int(stats.get('num_requests_running', 0))} reqs, "
            f"Waiting: {int(stats.get('num_requests_waiting', 0))} reqs, "
            f"KV cache usage: {100.0 * float(stats.get('kv_cache_usage_perc', 0.0)):.1f}%, "
            f"prefix cache hit rate: {hit_rate:.1f}%"
        )
        self._log.info(line)
        return line

    # ---- exposition (any thread) ----------------------------------------

    def render(self) -> tuple[bytes, str]:
        """The Prometheus text exposition and its content type."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
