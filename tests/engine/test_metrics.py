"""EngineMetrics: Prometheus series from engine stats and request outputs,
and the periodic stats log line."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvpage.engine.histograms import TOKEN_GAP_BUCKETS, buckets_1_2_5
from kvpage.engine.metrics import EngineMetrics, request_finish_reason
from kvpage.outputs import CompletionOutput, RequestMetrics, RequestOutput
from prometheus_client import CollectorRegistry, Histogram, generate_latest


def _value(m: EngineMetrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, {"model_name": "m", "engine": "0", **labels})


def _stats(**overrides: float) -> dict[str, float]:
    stats = {"num_requests_running": 3, "num_requests_waiting": 2, "kv_cache_usage_perc": 0.25,
             "prefix_cache_query_tokens": 100, "prefix_cache_hit_tokens": 40,
             "num_preemptions": 1, "last_step_tokens": 17, "prompt_tokens_total": 120,
             "generation_tokens_total": 30}
    stats.update(overrides)
    return stats


def _output(request_id: str, tokens: int, reason: str | None, *, t0: float = 100.0,
            scheduled: float = 100.5, first: float = 101.0, last: float = 101.0,
            finished: float | None = None) -> RequestOutput:
    metrics = RequestMetrics(arrival_time=t0, first_scheduled_time=scheduled,
                             first_token_time=first, last_token_time=last,
                             finished_time=finished)
    return RequestOutput(request_id, None, [1, 2], [CompletionOutput(0, "x", [5] * tokens,
                                                                     finish_reason=reason)],
                         reason is not None, metrics)


def test_gauges_and_counters_follow_running_totals() -> None:
    m = EngineMetrics("m")
    m.on_step(_stats())
    assert _value(m, "kvpage:num_requests_running") == 3
    assert _value(m, "kvpage:num_requests_waiting") == 2
    assert _value(m, "kvpage:kv_cache_usage_perc") == 0.25
    assert _value(m, "kvpage:step_executables_pending") == 0
    pending = [7]
    m.track_pending(lambda: pending[0])  # read at each scrape, steps or not
    assert _value(m, "kvpage:step_executables_pending") == 7
    pending[0] = 0
    assert _value(m, "kvpage:step_executables_pending") == 0
    assert _value(m, "kvpage:prefix_cache_queries_total") == 100
    assert _value(m, "kvpage:prefix_cache_hits_total") == 40
    assert _value(m, "kvpage:num_preemptions_total") == 1
    assert _value(m, "kvpage:prompt_tokens_total") == 120
    assert _value(m, "kvpage:generation_tokens_total") == 30
    m.on_step(_stats(generation_tokens_total=45, num_requests_running=0))
    assert _value(m, "kvpage:generation_tokens_total") == 45  # +15, not +45
    assert _value(m, "kvpage:num_requests_running") == 0
    m.on_step(_stats(generation_tokens_total=5))  # the engine's total was reset
    assert _value(m, "kvpage:generation_tokens_total") == 50
    assert _value(m, "kvpage:iteration_tokens_total_count") == 3
    assert _value(m, "kvpage:iteration_tokens_total_sum") == 51
    m.on_step(_stats(), ran=False)  # no plan ran: no iteration sample
    assert _value(m, "kvpage:iteration_tokens_total_count") == 3


def test_speculative_decoding_counters_use_vllm_names() -> None:
    m = EngineMetrics("m", prefix="vllm")
    m.on_step(_stats(spec_decode_num_drafts=4, spec_decode_num_draft_tokens=18,
                     spec_decode_num_accepted_tokens=11))
    assert _value(m, "vllm:spec_decode_num_drafts_total") == 4
    assert _value(m, "vllm:spec_decode_num_draft_tokens_total") == 18
    assert _value(m, "vllm:spec_decode_num_accepted_tokens_total") == 11


def test_request_latencies_and_finish_reasons() -> None:
    m = EngineMetrics("m")
    # latencies count from when the outputs are delivered (``now``), not from
    # when the engine sampled the tokens (first/last)
    m.on_outputs([_output("a", 1, None, first=100.9, last=100.9)], now=101.0)
    m.on_outputs([_output("a", 1, None, last=101.2)], now=101.25)
    m.on_outputs([_output("a", 1, "stop", last=101.7, finished=101.8)], now=102.0)
    assert _value(m, "kvpage:time_to_first_token_seconds_count") == 1
    assert _value(m, "kvpage:time_to_first_token_seconds_sum") == pytest.approx(1.0)
    assert _value(m, "kvpage:request_queue_time_seconds_sum") == pytest.approx(0.5)
    assert _value(m, "kvpage:inter_token_latency_seconds_count") == 2
    assert _value(m, "kvpage:inter_token_latency_seconds_sum") == pytest.approx(1.0)
    assert _value(m, "kvpage:e2e_request_latency_seconds_sum") == pytest.approx(2.0)
    assert _value(m, "kvpage:request_success_total", finished_reason="stop") == 1
    m.on_outputs([_output("b", 0, "abort", finished=101.0)], now=101.0)
    m.forget("c", "error")
    assert _value(m, "kvpage:request_success_total", finished_reason="abort") == 1
    assert _value(m, "kvpage:request_success_total", finished_reason="error") == 1


def test_request_finish_reason_of_several_samples() -> None:
    out = _output("a", 1, "length")
    out.outputs.append(CompletionOutput(1, "", [], finish_reason="abort"))
    assert request_finish_reason(out) == "abort"
    assert request_finish_reason(_output("b", 1, "stop")) == "stop"


def test_registries_are_private() -> None:
    a, b = EngineMetrics("m"), EngineMetrics("m", registry=CollectorRegistry())
    a.on_step(_stats())
    assert _value(a, "kvpage:prompt_tokens_total") == 120
    assert _value(b, "kvpage:prompt_tokens_total") == 0
    text, content_type = a.render()
    assert b"kvpage:prompt_tokens_total" in text and content_type.startswith("text/plain")


def test_log_line_every_interval(caplog: pytest.LogCaptureFixture) -> None:
    m = EngineMetrics("m", log_interval_s=5.0)
    start = m._log_time
    assert m.maybe_log(_stats(), now=start + 1.0) is None
    with caplog.at_level(logging.INFO, logger="kvpage.engine.metrics"):
        line = m.maybe_log(_stats(), now=start + 10.0)
    assert line is not None and line in caplog.text
    assert "prompt throughput 12.0 tokens/s" in line
    assert "generation throughput 3.0 tokens/s" in line
    assert "Running: 3 reqs, Waiting: 2 reqs" in line
    assert "KV cache usage: 25.0%" in line and "prefix cache hit rate: 40.0%" in line
    line = m.maybe_log(_stats(prompt_tokens_total=170, prefix_cache_query_tokens=150,
                              prefix_cache_hit_tokens=90), now=start + 15.0)
    assert line is not None
    assert "prompt throughput 10.0 tokens/s" in line and "hit rate: 100.0%" in line
    assert EngineMetrics("m", log_interval_s=None).maybe_log(_stats(), now=1e9) is None


def test_vllm_request_series() -> None:
    m = EngineMetrics("m", max_model_len=2048)
    m.on_add("a", 2, 64)
    out = _output("a", 1, None, scheduled=100.5)
    out.outputs.append(CompletionOutput(1, "y", [6], finish_reason=None))
    m.on_outputs([out], now=101.0)  # first tokens of both samples delivered
    m.on_outputs([_output("a", 2, None)], now=101.5)
    m.on_outputs([_output("a", 1, "length", finished=102.0)], now=102.0)
    assert _value(m, "kvpage:request_prompt_tokens_sum") == 2
    assert _value(m, "kvpage:request_generation_tokens_sum") == 5
    assert _value(m, "kvpage:request_max_num_generation_tokens_sum") == 4
    assert _value(m, "kvpage:request_params_n_sum") == 2
    assert _value(m, "kvpage:request_params_max_tokens_sum") == 64
    assert _value(m, "kvpage:request_prefill_time_seconds_sum") == pytest.approx(0.5)
    assert _value(m, "kvpage:request_decode_time_seconds_sum") == pytest.approx(1.0)
    assert _value(m, "kvpage:request_inference_time_seconds_sum") == pytest.approx(1.5)
    # decode time over the longest sample's tokens after its first: 1.0 / 3
    assert _value(m, "kvpage:time_per_output_token_seconds_sum") == pytest.approx(1 / 3)
    assert _value(m, "kvpage:time_to_first_token_seconds_sum") == pytest.approx(1.0)
    assert _value(m, "kvpage:request_prompt_tokens_bucket", le="2.0") == 1
    assert _value(m, "kvpage:request_prompt_tokens_bucket", le="2000.0") == 1
    assert m.registry.get_sample_value("kvpage:request_prompt_tokens_bucket",
                                       {"model_name": "m", "engine": "0", "le": "5000.0"}) is None


def test_vllm_prefix_and_cache_config_info() -> None:
    m = EngineMetrics("m", prefix="vllm", cache_config={"block_size": 16, "num_gpu_blocks": 99})
    m.on_step(_stats())
    text = m.render()[0].decode()
    assert 'vllm:num_requests_running{engine="0",model_name="m"} 3.0' in text
    assert 'vllm:cache_config_info{block_size="16",num_gpu_blocks="99"} 1.0' in text
    assert "kvpage:" not in text
    with pytest.raises(ValueError, match="prefix"):
        EngineMetrics("m", prefix="tgi")


def test_buckets_1_2_5() -> None:
    assert buckets_1_2_5(100) == (1, 2, 5, 10, 20, 50, 100)
    assert buckets_1_2_5(1) == (1,)


@given(st.lists(st.one_of(st.floats(-1.0, 100.0), st.sampled_from(
    [0.0, 0.001, 0.0025, 0.005, 0.04, 1.0, 80.0, float("inf"), float("nan")])), max_size=64))
def test_observe_many_counts_as_prometheus_client_does(amounts: list[float]) -> None:
    """The inter-token latencies of a step, counted in one pass (``observe_many``) or one
    at a time (``observe``), give the series prometheus_client's ``Histogram`` gives
    with one ``observe`` per amount (bounds included, +Inf, NaN), in the same text."""
    batched, single = EngineMetrics("m"), EngineMetrics("m")
    batched.inter_token_latency.observe_many(amounts)
    for amount in amounts:
        single.inter_token_latency.observe(amount)
    reference = CollectorRegistry(auto_describe=True)
    histogram = Histogram("kvpage:inter_token_latency_seconds",
                          "Time between successive tokens of a request.",
                          ["model_name", "engine"], registry=reference,
                          buckets=TOKEN_GAP_BUCKETS).labels("m", "0")
    for amount in amounts:
        histogram.observe(amount)

    def samples(registry: CollectorRegistry) -> dict[tuple[str, str], float]:
        return {(s.name, s.labels.get("le", "")): s.value for family in registry.collect()
                if family.name.endswith("inter_token_latency_seconds")
                for s in family.samples if not s.name.endswith("_created")}

    def text(registry: CollectorRegistry) -> list[str]:
        lines = generate_latest(registry).decode().splitlines()
        return [line for line in lines if "inter_token_latency" in line
                and not line.startswith("kvpage:inter_token_latency_seconds_created")
                and "_sum" not in line]

    expected = samples(reference)
    sum_key = ("kvpage:inter_token_latency_seconds_sum", "")
    for m in (batched, single):
        got = samples(m.registry)
        assert got.pop(sum_key) == pytest.approx(expected[sum_key], nan_ok=True)
        assert got == {k: v for k, v in expected.items() if k != sum_key}
        assert text(m.registry) == text(reference)
    assert len(expected) == 16  # 14 buckets (+Inf included), count, sum


def test_streaming_outputs_observe_inter_token_latency_once_per_token() -> None:
    m = EngineMetrics("m")
    outputs = [_output(f"r{i}", 1, None) for i in range(20)]
    m.on_outputs(outputs, now=10.0)
    m.on_outputs(outputs, now=10.5)  # every request's second token, 0.5 s later
    m.on_outputs(outputs, now=10.75)
    assert _value(m, "kvpage:inter_token_latency_seconds_count") == 40
    assert _value(m, "kvpage:inter_token_latency_seconds_sum") == pytest.approx(20 * 0.75)
    assert _value(m, "kvpage:inter_token_latency_seconds_bucket", le="0.256") == 20
    assert _value(m, "kvpage:inter_token_latency_seconds_bucket", le="0.512") == 40
