"""Serving metrics: Prometheus series and the periodic engine stats log line.

This file owns the metric definitions (vLLM's metric names and labels,
``model_name`` and ``engine``, under a ``kvpage:`` prefix, or ``vllm:`` with
``prefix="vllm"`` so that vLLM's Grafana dashboard and alerts work unchanged)
on one private ``CollectorRegistry`` per ``EngineMetrics`` (no process-global
state), their update from ``LLMEngine.get_stats()`` after every step and from
the ``RequestOutput``s each step produces, and a throughput log line written
every few seconds while the engine is busy.

Latencies are measured as a client sees them: a token counts as delivered
when its output is handed to the request's stream (``on_outputs`` is called
right after), not when the device sampled it, so the time to first token
includes the step the outputs trail the device by. Per request (vLLM's
definitions): queue = arrival to first scheduled; prefill = first scheduled
to first token; decode = first to last token; inference = first scheduled to
last token; time per output token = decode / (generated tokens - 1).

Update methods are called from the engine thread only; ``render`` may be
called from any thread (prometheus_client guards its values with locks, and
:class:`~kvpage.engine.histograms.BatchedHistogram` its counts).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from kvpage.engine.histograms import (
    FAST_LATENCY_BUCKETS,
    N_BUCKETS,
    REQUEST_BUCKETS,
    STEP_TOKEN_BUCKETS,
    TOKEN_GAP_BUCKETS,
    TPOT_BUCKETS,
    BatchedHistogram,
    buckets_1_2_5,
)
from kvpage.outputs import RequestOutput

if TYPE_CHECKING:
    from kvpage.engine.llm_engine import LLMEngine

PREFIX = "kvpage:"
PREFIXES = ("kvpage", "vllm")
ENGINE_INDEX = "0"
"""The ``engine`` label (vLLM's data-parallel engine index; kvpage runs one)."""

logger = logging.getLogger("kvpage.engine.metrics")


@dataclass(slots=True)
class _Seen:
    """What was already observed for one live request."""

    first_token: bool = False
    queued: bool = False
    first_token_time: float | None = None
    last_token_time: float | None = None
    prompt_tokens: int = 0
    generation_tokens: int = 0
    sample_tokens: dict[int, int] | None = None
    n: int | None = None
    max_tokens: int | None = None


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

    ``log_interval_s=None`` turns the log line off. ``prefix``: "kvpage" or
    "vllm" (the series' name prefix). ``max_model_len`` bounds the token-count
    buckets. ``cache_config``: the labels of the ``cache_config_info`` gauge
    (vLLM's; see ``cache_config_info``).
    """

    def __init__(
        self,
        model_name: str = "kvpage",
        *,
        registry: CollectorRegistry | None = None,
        log_interval_s: float | None = 5.0,
        log: logging.Logger | None = None,
        prefix: str = "kvpage",
        max_model_len: int = 1 << 17,
        cache_config: Mapping[str, Any] | None = None,
    ) -> None:
        prefix = prefix.removesuffix(":")
        if prefix not in PREFIXES:
            raise ValueError(f"metrics prefix must be one of {PREFIXES}, got {prefix!r}")
        self.prefix = prefix + ":"
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        self.log_interval_s = log_interval_s
        self._log = log or logger
        reg, label = self.registry, ["model_name", "engine"]
        name_of = self.prefix.__add__
        values = (model_name, ENGINE_INDEX)

        def gauge(name: str, doc: str) -> Any:
            return Gauge(name_of(name), doc, label, registry=reg).labels(*values)

        def counter(name: str, doc: str) -> Any:
            return Counter(name_of(name), doc, label, registry=reg).labels(*values)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name_of(name), doc, label, registry=reg,
                             buckets=buckets).labels(*values)

        self.num_requests_running = gauge("num_requests_running",
                                          "Requests in the running batch.")
        self.num_requests_waiting = gauge("num_requests_waiting",
                                          "Requests queued, waiting to be scheduled.")
        self.kv_cache_usage_perc = gauge(
            "kv_cache_usage_perc", "Fraction of KV cache blocks in use (1.0 = full).")
        self.step_executables_pending = gauge(
            "step_executables_pending",
            "Step executables the background warm-up has not built yet (0: full speed).")
        """Read at each scrape (:meth:`track_pending`): it changes while no step runs."""
        self.prefix_cache_queries = counter(
            "prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = counter(
            "prefix_cache_hits_total", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = counter("num_preemptions_total",
                                       "Sequences preempted to free KV blocks.")
        self.prompt_tokens = counter("prompt_tokens_total", "Prompt tokens received.")
        self.generation_tokens = counter("generation_tokens_total", "Tokens generated.")
        self.spec_decode_drafts = counter(
            "spec_decode_num_drafts_total",
            "Speculative decoding: sequence rows that verified drafted tokens.")
        self.spec_decode_draft_tokens = counter(
            "spec_decode_num_draft_tokens_total", "Speculative decoding: tokens drafted.")
        self.spec_decode_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens_total",
            "Speculative decoding: drafted tokens the model accepted.")
        self._request_success = Counter(
            name_of("request_success_total"), "Finished requests, by finish reason.",
            ["model_name", "engine", "finished_reason"], registry=reg,
        )
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds",
            "Arrival to the first token delivered to the request's stream.",
            FAST_LATENCY_BUCKETS)
        self.inter_token_latency = BatchedHistogram(
            name_of("inter_token_latency_seconds"),
            "Time between successive tokens of a request.",
            dict(zip(label, values, strict=True)), TOKEN_GAP_BUCKETS, reg)
        """Observed once per token of every streaming request: counted in one pass."""
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds", "Arrival to finish of a request.", REQUEST_BUCKETS)
        self.request_queue_time = histogram(
            "request_queue_time_seconds", "Arrival to first scheduled step.",
            FAST_LATENCY_BUCKETS)
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens processed by one engine step.",
            STEP_TOKEN_BUCKETS)
        self.time_per_output_token = histogram(
            "time_per_output_token_seconds",
            "Per finished request: decode time / (generated tokens - 1).", TPOT_BUCKETS)
        self.request_inference_time = histogram(
            "request_inference_time_seconds", "First scheduled to last token of a request.",
            REQUEST_BUCKETS)
        self.request_prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduled to first token of a request.",
            REQUEST_BUCKETS)
        self.request_decode_time = histogram(
            "request_decode_time_seconds", "First to last token of a request.",
            REQUEST_BUCKETS)
        token_buckets = buckets_1_2_5(max_model_len)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens of a finished request.", token_buckets)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Tokens generated for a finished request (all samples).",
            token_buckets)
        self.request_max_num_generation_tokens = histogram(
            "request_max_num_generation_tokens",
            "Most tokens generated by one sample of a finished request.", token_buckets)
        self.request_params_n = histogram("request_params_n", "The n of finished requests.",
                                          N_BUCKETS)
        self.request_params_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens of finished requests.", token_buckets)
        info = dict(cache_config or {})
        self.cache_config_info = Gauge(
            name_of("cache_config_info"), "Information of the KV cache configuration (value 1).",
            sorted(info), registry=reg)
        if info:
            self.cache_config_info.labels(**{k: str(v) for k, v in info.items()}).set(1)
        else:
            self.cache_config_info.set(1)

        self._totals = {  # get_stats() key of a running total -> its counter
            "prefix_cache_query_tokens": self.prefix_cache_queries,
            "prefix_cache_hit_tokens": self.prefix_cache_hits,
            "num_preemptions": self.num_preemptions,
            "prompt_tokens_total": self.prompt_tokens,
            "generation_tokens_total": self.generation_tokens,
            "spec_decode_num_drafts": self.spec_decode_drafts,
            "spec_decode_num_draft_tokens": self.spec_decode_draft_tokens,
            "spec_decode_num_accepted_tokens": self.spec_decode_accepted_tokens,
        }
        self._last_totals: dict[str, float] = {}
        self._live: dict[str, _Seen] = {}
        self._log_time = time.monotonic()
        self._log_totals: dict[str, float] = {}

    def track_pending(self, pending: Callable[[], int]) -> None:
        """Report ``pending()`` as ``step_executables_pending`` at every scrape."""
        self.step_executables_pending.set_function(pending)

    # ---- updates (engine thread) ----------------------------------------

    def request_success(self, finished_reason: str) -> Any:
        """The ``request_success_total`` child for one finish reason."""
        return self._request_success.labels(self.model_name, ENGINE_INDEX, finished_reason)

    def on_add(self, request_id: str, n: int | None, max_tokens: int | None) -> None:
        """A request was accepted: remember its parameters for the
        ``request_params_*`` series, observed when it finishes."""
        seen = self._live.get(request_id)
        if seen is None:
            seen = self._live[request_id] = _Seen()
        seen.n, seen.max_tokens = n, max_tokens

    def on_step(self, stats: Mapping[str, Any], outputs: Iterable[RequestOutput] = (),
                *, ran: bool = True) -> None:
        """Update from ``get_stats()`` after a step (``ran``: it ran a plan)
        and from the outputs that step returned."""
        self.num_requests_running.set(stats.get("num_requests_running", 0))
        self.num_requests_waiting.set(stats.get("num_requests_waiting", 0))
        self.kv_cache_usage_perc.set(stats.get("kv_cache_usage_perc", 0.0))
        for key, counter in self._totals.items():
            if key not in stats:
                continue
            value = float(stats[key])
            previous = self._last_totals.get(key, 0.0)
            # a running total that went down was reset: count from the new base
            delta = value - previous if value >= previous else value
            if delta > 0:
                counter.inc(delta)
            self._last_totals[key] = value
        step_tokens = stats.get("last_step_tokens", 0)
        if ran and step_tokens:
            self.iteration_tokens.observe(step_tokens)
        self.on_outputs(outputs)

    def on_outputs(self, outputs: Iterable[RequestOutput],
                   finished_reason: str | None = None, *, now: float | None = None) -> None:
        """Latency histograms and finish counts from request outputs just
        delivered to their streams (at ``now``, default the current
        ``time.monotonic()``); ``finished_reason`` overrides the reason of
        finished ones."""
        now = time.monotonic() if now is None else now
        gaps: list[float] = []  # inter-token latencies, observed together at the end
        for out in outputs:
            seen = self._live.get(out.request_id)
            if seen is None:
                seen = self._live[out.request_id] = _Seen()
            m = out.metrics
            seen.prompt_tokens = max(seen.prompt_tokens, len(out.prompt_token_ids))
            if not seen.queued and m.queue_time is not None:
                seen.queued = True
                self.request_queue_time.observe(max(0.0, m.queue_time))
            new_tokens = 0
            for c in out.outputs:
                if c.token_ids:
                    new_tokens += len(c.token_ids)
                    if seen.sample_tokens is None:
                        seen.sample_tokens = {}
                    seen.sample_tokens[c.index] = seen.sample_tokens.get(c.index, 0) \
                        + len(c.token_ids)
            if new_tokens:
                seen.generation_tokens += new_tokens
                if not seen.first_token:
                    seen.first_token = True
                    seen.first_token_time = now
                    self.time_to_first_token.observe(max(0.0, now - m.arrival_time))
                elif seen.last_token_time is not None and now > seen.last_token_time:
                    gaps.append(now - seen.last_token_time)
                seen.last_token_time = now
            if out.finished:
                self._live.pop(out.request_id, None)
                self.request_success(finished_reason or request_finish_reason(out)).inc()
                self._observe_finished(out, seen, now)
        self.inter_token_latency.observe_many(gaps)

    def _observe_finished(self, out: RequestOutput, seen: _Seen, now: float) -> None:
        m = out.metrics
        self.e2e_request_latency.observe(max(0.0, now - m.arrival_time))
        self.request_prompt_tokens.observe(seen.prompt_tokens)
        self.request_generation_tokens.observe(seen.generation_tokens)
        self.request_max_num_generation_tokens.observe(
            max(seen.sample_tokens.values()) if seen.sample_tokens else 0)
        if seen.n is not None:
            self.request_params_n.observe(seen.n)
        if seen.max_tokens is not None:
            self.request_params_max_tokens.observe(seen.max_tokens)
        scheduled = m.first_scheduled_time
        first, last = seen.first_token_time, seen.last_token_time
        if scheduled is not None and first is not None and last is not None:
            self.request_prefill_time.observe(max(0.0, first - scheduled))
            self.request_inference_time.observe(max(0.0, last - scheduled))
        if first is not None and last is not None:
            decode = max(0.0, last - first)
            self.request_decode_time.observe(decode)
            if seen.generation_tokens > 1:
                # per sample: the samples of a request decode side by side
                per_sample = max(seen.sample_tokens.values()) if seen.sample_tokens else 0
                if per_sample > 1:
                    self.time_per_output_token.observe(decode / (per_sample - 1))

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


def cache_config_info(engine: LLMEngine) -> dict[str, str]:
    """The labels of vLLM's ``cache_config_info`` gauge for an ``LLMEngine``."""
    config = engine.config
    info: dict[str, Any] = {
        "num_cpu_blocks": 0,
        "block_size": config.block_size,
        "enable_prefix_caching": config.enable_prefix_caching,
        "gpu_memory_utilization": config.gpu_memory_utilization,
        "cache_dtype": engine.kv_cache_dtype,
        "num_gpu_blocks": engine.runner.num_blocks,
        "max_model_len": engine.max_model_len,
    }
    return {k: str(v) for k, v in info.items()}
