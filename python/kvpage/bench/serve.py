"""``kvpage bench serve``: load a running OpenAI-compatible server and time it.

Requests go to ``/v1/completions`` with token-id prompts and ``stream: true``;
each streamed chunk is timestamped on arrival. Time to first token (TTFT) is
send -> first chunk with text; inter-token latency (ITL) is the gap between
consecutive chunks; time per output token (TPOT) is (latency - TTFT) /
(output tokens - 1), the token count taken from the final usage chunk.

Arrivals are Poisson at ``--request-rate`` requests/s (``inf``: all at once);
``--max-concurrency`` bounds the requests in flight. By default only loopback
servers are accepted.

    kvpage serve MODEL_DIR --port 8000 &
    kvpage bench serve --base-url http://127.0.0.1:8000 --dataset sharegpt \\
        --input-len 230 --output-len 200 --num-prompts 100 --request-rate 4
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvpage.bench.common import (
    BenchRequest,
    fit_to_model_len,
    mean,
    percentile,
    write_json,
)
from kvpage.bench.sse import SSEEvents


@dataclass(slots=True)
class RequestRecord:
    """One request as the client saw it (times in seconds)."""

    ok: bool
    prompt_tokens: int
    sent: float = float("nan")
    """``time.perf_counter()`` when the request was sent."""
    output_tokens: int = 0
    ttft: float = float("nan")
    latency: float = float("nan")
    itls: list[float] = field(default_factory=list)
    error: str = ""


@dataclass(slots=True)
class ServeResult:
    """The run's totals and latency statistics (milliseconds)."""

    completed: int
    failed: int
    duration_s: float
    prompt_tokens: int
    output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    max_concurrency: int | None
    request_rate: float
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    latency_ms: dict[str, float]
    errors: list[str]


def _stats_ms(values: Sequence[float]) -> dict[str, float]:
    ms = [1e3 * v for v in values]
    return {"mean": mean(ms), "median": percentile(ms, 50), "p99": percentile(ms, 99)}


def summarize(
    records: Sequence[RequestRecord],
    duration_s: float,
    max_concurrency: int | None = None,
    request_rate: float = float("inf"),
) -> ServeResult:
    """Totals, throughput and latency percentiles of finished requests."""
    done = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in done)
    output = sum(r.output_tokens for r in done)
    tpots = [
        (r.latency - r.ttft) / (r.output_tokens - 1) for r in done if r.output_tokens > 1
    ]
    duration = max(duration_s, 1e-9)
    return ServeResult(
        completed=len(done),
        failed=len(records) - len(done),
        duration_s=duration_s,
        prompt_tokens=prompt,
        output_tokens=output,
        request_throughput=len(done) / duration,
        output_throughput=output / duration,
        total_token_throughput=(prompt + output) / duration,
        max_concurrency=max_concurrency,
        request_rate=request_rate,
        ttft_ms=_stats_ms([r.ttft for r in done]),
        tpot_ms=_stats_ms(tpots),
        itl_ms=_stats_ms([gap for r in done for gap in r.itls]),
        latency_ms=_stats_ms([r.latency for r in done]),
        errors=sorted({r.error for r in records if not r.ok})[:5],
    )


def format_result(result: ServeResult) -> str:
    """The result block: counts and throughput, then TTFT/TPOT/ITL/E2E
    mean, median and p99 in milliseconds."""
    width = 50

    def line(label: str, value: Any) -> str:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        return f"{label:<38}{text:>12}"

    def section(name: str) -> str:
        return f" {name} ".center(width, "-")

    rate = "inf" if result.request_rate == float("inf") else f"{result.request_rate:g}"
    lines = [
        " kvpage serving benchmark ".center(width, "="),
        line("Requests completed:", result.completed),
        line("Requests failed:", result.failed),
        line("Request rate (req/s):", rate),
        line("Max concurrency:", result.max_concurrency or "none"),
        line("Duration (s):", result.duration_s),
        line("Prompt tokens:", result.prompt_tokens),
        line("Output tokens:", result.output_tokens),
        line("Request throughput (req/s):", result.request_throughput),
        line("Output token throughput (tok/s):", result.output_throughput),
        line("Total token throughput (tok/s):", result.total_token_throughput),
    ]
    for name, stats in (
        ("Time to first token", result.ttft_ms),
        ("Time per output token (after the 1st)", result.tpot_ms),
        ("Inter-token latency", result.itl_ms),
        ("End-to-end latency", result.latency_ms),
    ):
        short = {"Time to first token": "TTFT", "Inter-token latency": "ITL",
                 "End-to-end latency": "E2E"}.get(name, "TPOT")
        lines.append(section(name))
        lines.append(line(f"Mean {short} (ms):", stats["mean"]))
        lines.append(line(f"Median {short} (ms):", stats["median"]))
        lines.append(line(f"P99 {short} (ms):", stats["p99"]))
    lines.append("=" * width)
    for error in result.errors:
        lines.append(f"error: {error}")
    return "\n".join(lines)


def check_loopback(base_url: str) -> None:
    """ValueError unless ``base_url`` names this machine (``--allow-remote`` lifts it)."""
    from kvpage.bench.loopback import check_loopback as check

    check(base_url, "--allow-remote")


async def _send(
    client: Any, url: str, headers: dict[str, str], body: dict[str, Any], prompt_len: int
) -> RequestRecord:
    start = time.perf_counter()
    record = RequestRecord(ok=False, prompt_tokens=prompt_len, sent=start)
    last = None
    chunks = 0
    usage_tokens = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as response:
            if response.status_code != 200:
                text = (await response.aread()).decode(errors="replace")
                record.error = f"HTTP {response.status_code}: {text[:200]}"
                return record
            async for event in SSEEvents(response):
                if "error" in event:
                    record.error = str(event["error"].get("message", event["error"]))[:200]
                    return record
                now = time.perf_counter()
                if event.get("usage"):
                    usage_tokens = event["usage"].get("completion_tokens")
                choices = event.get("choices") or []
                if any(c.get("text") for c in choices):
                    if last is None:
                        record.ttft = now - start
                    else:
                        record.itls.append(now - last)
                    last = now
                    chunks += 1
    except Exception as exc:  # a benchmark reports failures, it does not stop
        record.error = f"{type(exc).__name__}: {exc}"[:200]
        return record
    record.latency = time.perf_counter() - start
    record.output_tokens = usage_tokens if usage_tokens is not None else chunks
    if last is None and record.output_tokens:
        record.ttft = record.latency  # all text arrived in the final chunk
    record.ok = True
    return record


async def run_requests_online(
    base_url: str,
    requests: Sequence[BenchRequest],
    *,
    model: str,
    api_key: str | None = None,
    max_concurrency: int | None = None,
    ignore_eos: bool = True,
    timeout_s: float = 300.0,
) -> tuple[list[RequestRecord], float]:
    """Send ``requests`` at their arrival times; returns the records (in
    request order) and the wall time from the first send to the last reply."""
    import httpx

    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    connections = min(max_concurrency or len(requests), 1024) or 1
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)

    async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
        start = time.perf_counter()

        async def one(r: BenchRequest) -> RequestRecord:
            delay = r.arrival - (time.perf_counter() - start)
            if delay > 0:
                await asyncio.sleep(delay)
            body = {
                "model": model,
                "prompt": r.prompt_token_ids,
                "max_tokens": r.output_len,
                "ignore_eos": ignore_eos,
                "temperature": 1.0,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if gate is None:
                return await _send(client, url, headers, body, len(r.prompt_token_ids))
            async with gate:
                return await _send(client, url, headers, body, len(r.prompt_token_ids))

        records = await asyncio.gather(*(one(r) for r in requests))
        return list(records), time.perf_counter() - start


def server_info(base_url: str, api_key: str | None = None) -> tuple[str, int | None]:
    """The first served model name and its ``max_model_len`` (GET /v1/models)."""
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    first = response.json()["data"][0]
    return str(first["id"]), first.get("max_model_len")


def bench_serve(
    base_url: str,
    requests: Sequence[BenchRequest],
    *,
    model: str | None = None,
    api_key: str | None = None,
    max_concurrency: int | None = None,
    request_rate: float = float("inf"),
    ignore_eos: bool = True,
    timeout_s: float = 300.0,
) -> ServeResult:
    """Run ``requests`` against the server at ``base_url`` and summarize."""
    served, max_model_len = server_info(base_url, api_key)
    if max_model_len:
        requests, _ = fit_to_model_len(requests, int(max_model_len))
    records, duration = asyncio.run(
        run_requests_online(
            base_url, requests, model=model or served, api_key=api_key,
            max_concurrency=max_concurrency, ignore_eos=ignore_eos, timeout_s=timeout_s,
        )
    )
    return summarize(records, duration, max_concurrency, request_rate)


def add_parser(sub: Any) -> None:
    """Add ``serve`` to the ``kvpage bench`` subcommands."""
    from kvpage.bench.throughput import add_workload_args

    p = sub.add_parser(
        "serve",
        help="online: stream requests to a running server, time TTFT/TPOT/ITL",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="server address (default: %(default)s)"
    )
    p.add_argument("--model", default=None, help="model name to request (default: the server's)")
    p.add_argument(
        "--api-key", default=None, help="sent as 'Authorization: Bearer KEY' (if the server needs)"
    )
    add_workload_args(p, num_prompts=100, input_len=230, output_len=200)
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrivals per second (default inf: send every request at once)",
    )
    p.add_argument(
        "--max-concurrency",
        type=int,
        default=None,
        help="most requests in flight at once (default: no bound)",
    )
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="ask for exactly --output-len tokens, ignoring EOS (default: on)",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=500,
        help="prompt token ids are drawn from [10, VOCAB_SIZE); the default fits any model, "
        "the tiny one included",
    )
    p.add_argument(
        "--timeout", type=float, default=300.0, help="seconds one request may take (default 300)"
    )
    p.add_argument(
        "--allow-remote",
        action="store_true",
        help="allow a --base-url that is not this machine (default: loopback only)",
    )
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON")
    p.set_defaults(func=cmd_serve)


def cmd_serve(args: argparse.Namespace) -> int:
    from kvpage.bench.throughput import workload_from_args
    from kvpage.system.extras import BENCH_SERVE_MODULES, require

    require("kvpage bench serve", BENCH_SERVE_MODULES)

    if not args.allow_remote:
        check_loopback(args.base_url)
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError("--max-concurrency must be >= 1")
    if not args.request_rate > 0:
        raise ValueError("--request-rate must be > 0 (or inf)")
    requests = workload_from_args(args, max(args.vocab_size, 11), args.request_rate)
    result = bench_serve(
        args.base_url, requests, model=args.model, api_key=args.api_key,
        max_concurrency=args.max_concurrency, request_rate=args.request_rate,
        ignore_eos=args.ignore_eos, timeout_s=args.timeout,
    )
    print(format_result(result))
    if args.json:
        write_json(args.json, {"command": "serve", "base_url": args.base_url,
                               "result": asdict(result)})
    return 0 if result.failed == 0 else 1

