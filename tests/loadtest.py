"""Load test for ``kvpage serve``: many concurrent streaming clients for a
bounded time, then the checks that nothing was lost, leaked or let grow.

    python tests/loadtest.py --clients 300 --duration 60      # spawns kvpage serve
    python tests/loadtest.py --url http://127.0.0.1:8000 --model-name NAME

By default it builds (once) the tiny random Llama of ``kvpage.model.tiny_model``,
starts ``python -m kvpage.cli serve`` on it on 127.0.0.1 and a free port, and
stops it with SIGTERM at the end. ``--url`` drives a server that is already
running instead (loopback addresses only). ``run_load`` and
``InProcessServer`` are the same machinery for tests (``tests/openai/test_load_smoke.py``
imports this file). A test harness, not part of the installed package: it needs
kvpage importable (installed, or ``PYTHONPATH=python``) and ``httpx``.

The workload: ``--clients`` clients, each a loop of one request, then an
exponential pause (mean ``--think-time``), so each client's arrivals are a
Poisson process; they start over ``--ramp`` seconds and send for
``--duration`` seconds, then the requests in flight finish. Requests are
mostly streaming completions with token-id prompts of mixed lengths (a few
long), some sharing one of a few prefixes (prefix-cache hits), some with
``n`` > 1, some chat completions and some non-streaming; ``--disconnect-frac``
of them hang up on purpose (before the first token, mid-stream, or during the
prefill of a long prompt). Phases: warm-up (not in the figures),
load, then optionally an overload burst (past capacity the server must shed
with 503 ``queue_full``) and recovery (everything succeeds again).

Checks (exit status 1 if one fails): no failed request (a failure is any
answer but 200 with every choice ending in "stop" or "length" and, when
streaming, ``[DONE]``; a 503 ``queue_full`` is counted as shed, not failed,
and only allowed in the overload phase); afterwards no request running or
waiting and ``kv_cache_usage_perc`` = 0 (``/metrics``); the spawned server
exits 0 on SIGTERM and logs that every KV block is free and the engine's
invariants hold; peak RSS under ``--max-rss-mb`` if given. Figures:
requests/s, output tokens/s, p50/p99 TTFT (send to first token) and ITL
(gap between successive token chunks of one choice), peak server RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import signal
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from kvpage.bench.common import default_model_dir, percentile
from kvpage.bench.loopback import check_loopback
from kvpage.bench.sse import SSEEvents
from server_harness import RSSMonitor, ServerProcess, Target, fetch_metrics, metric, wait_idle

OK_FINISH = frozenset({"stop", "length"})
DISCONNECT_KINDS = ("before_first_token", "mid_stream", "during_prefill")
_WORDS = (
    "river stone lantern orbit maple signal copper meadow harbor velvet quartz ember "
    "falcon tundra prism cobalt willow canyon marble thistle beacon glacier saffron "
    "compass ripple juniper lattice monsoon pebble quiver summit tangle vapor zephyr"
).split()


# ---- the workload --------------------------------------------------------------


@dataclass(slots=True)
class Workload:
    """What the clients send, and for how long."""

    clients: int = 200
    duration_s: float = 60.0
    think_time_s: float = 1.0
    """Mean of the exponential pause between two requests of one client."""
    ramp_s: float = 5.0
    prompt_len: tuple[int, int] = (4, 48)
    long_prompt_len: tuple[int, int] = (160, 320)
    long_prompt_frac: float = 0.05
    max_tokens: tuple[int, int] = (4, 64)
    shared_prefix_frac: float = 0.3
    num_prefixes: int = 4
    prefix_len: int = 64
    n_frac: float = 0.1
    """Fraction of requests with n = 2 or 3."""
    chat_frac: float = 0.2
    nonstream_frac: float = 0.05
    disconnect_frac: float = 0.0
    ignore_eos_frac: float = 0.5
    request_timeout_s: float = 300.0
    seed: int = 0


@dataclass(slots=True)
class RequestSpec:
    """One request to send."""

    path: str
    body: dict[str, Any]
    n: int
    long_prompt: bool = False
    disconnect: str | None = None
    disconnect_after: int = 0
    """``mid_stream``: hang up after this many token chunks."""

    @property
    def stream(self) -> bool:
        return bool(self.body.get("stream"))


class RequestFactory:
    """Draws ``RequestSpec``s for one target from a seeded generator."""

    def __init__(self, workload: Workload, target: Target, seed: int) -> None:
        self.w = workload
        self.t = target
        self.rng = random.Random(seed)
        prefix_rng = random.Random(workload.seed)  # the same prefixes for every client
        vocab = target.vocab_size
        self.lo = max(vocab // 4, 1) if vocab else 0
        self.prefixes = (
            [self._ids(prefix_rng, workload.prefix_len) for _ in range(workload.num_prefixes)]
            if vocab
            else []
        )
        self.system_prompts = [
            " ".join(prefix_rng.choice(_WORDS) for _ in range(24))
            for _ in range(workload.num_prefixes)
        ]

    def _ids(self, rng: random.Random, count: int) -> list[int]:
        assert self.t.vocab_size is not None
        return [rng.randrange(self.lo, self.t.vocab_size) for _ in range(count)]

    def _words(self, count: int) -> str:
        return " ".join(self.rng.choice(_WORDS) for _ in range(count))

    def make(self) -> RequestSpec:
        w, rng, limit = self.w, self.rng, self.t.max_model_len
        n = rng.choice((2, 3)) if rng.random() < w.n_frac else 1
        stream = rng.random() >= w.nonstream_frac
        disconnect = None
        if stream and rng.random() < w.disconnect_frac:
            disconnect = rng.choice(DISCONNECT_KINDS)
        long_prompt = disconnect == "during_prefill" or rng.random() < w.long_prompt_frac
        max_tokens = rng.randint(*w.max_tokens)
        body: dict[str, Any] = {
            "model": self.t.model,
            "stream": stream,
            "n": n,
            "temperature": rng.choice((0.0, 0.7, 1.0)),
            "ignore_eos": rng.random() < w.ignore_eos_frac,
        }
        if stream:
            body["stream_options"] = {"include_usage": True}
        if disconnect is not None:  # long enough that hanging up comes first
            max_tokens = w.max_tokens[1]
            body["ignore_eos"] = True
        chat = self.t.vocab_size is None or (not long_prompt and rng.random() < w.chat_frac)
        if chat:
            # text prompts: keep them short, their token count is unknown here
            max_tokens = min(max_tokens, max(limit // 4, 1))
            user = self._words(rng.randint(3, max(3, min(24, limit // 32))))
            messages = [{"role": "user", "content": user}]
            if rng.random() < w.shared_prefix_frac:
                messages.insert(0, {"role": "system", "content": rng.choice(self.system_prompts)})
            body |= {"messages": messages, "max_tokens": max_tokens}
            return RequestSpec(
                "/v1/chat/completions", body, n, long_prompt, disconnect, rng.randint(1, 4)
            )
        length = rng.randint(*(w.long_prompt_len if long_prompt else w.prompt_len))
        prompt: list[int] = []
        if self.prefixes and rng.random() < w.shared_prefix_frac:
            prompt = list(rng.choice(self.prefixes))
        prompt += self._ids(rng, length)
        budget = limit - 1 - max_tokens
        if len(prompt) > budget:
            prompt = prompt[: max(budget, 1)]
            max_tokens = min(max_tokens, limit - 1 - len(prompt))
        body |= {"prompt": prompt, "max_tokens": max(max_tokens, 1)}
        return RequestSpec("/v1/completions", body, n, long_prompt, disconnect, rng.randint(1, 4))


# ---- one request ---------------------------------------------------------------


@dataclass(slots=True)
class RequestResult:
    """What happened to one request."""

    path: str
    stream: bool
    n: int
    status: int | None = None
    ok: bool = False
    shed: bool = False
    """503 with code queue_full: the server refused it for lack of room."""
    disconnect: str | None = None
    """The client hung up on purpose (not a failure)."""
    error: str | None = None
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    latency: float = 0.0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reasons: dict[int, str] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return not (self.ok or self.shed or self.disconnect)


def _error_of(status: int, text: str) -> tuple[str, str | None]:
    try:
        error = json.loads(text)["error"]
        return f"{status} {error.get('code')}: {str(error.get('message'))[:200]}", error.get("code")
    except (ValueError, KeyError, TypeError):
        return f"{status} (not an OpenAI error body): {text[:200]}", None


def _usage(result: RequestResult, usage: dict[str, Any] | None) -> None:
    if usage:
        result.completion_tokens = int(usage.get("completion_tokens") or 0)
        result.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        result.cached_tokens = int(details.get("cached_tokens") or 0)


def _check_finished(result: RequestResult, n_choices: int) -> None:
    missing = [i for i in range(n_choices) if result.finish_reasons.get(i) not in OK_FINISH]
    if missing:
        reasons = {i: result.finish_reasons.get(i) for i in missing[:4]}
        result.error = result.error or f"choices without an ok finish reason: {reasons}"
    else:
        result.ok = result.error is None


async def send_request(
    http: httpx.AsyncClient, target: Target, spec: RequestSpec, timeout_s: float = 300.0
) -> RequestResult:
    """Send one request, read it to the end (or hang up as ``spec`` says)."""
    result = RequestResult(spec.path, spec.stream, spec.n)
    prompts = spec.body.get("prompt")
    n_prompts = (
        len(prompts)
        if isinstance(prompts, list) and prompts and isinstance(prompts[0], list | str)
        else 1
    )
    start = time.perf_counter()
    try:
        async with asyncio.timeout(timeout_s):
            if spec.stream:
                await _stream(http, target, spec, result, start, n_prompts * spec.n)
            else:
                response = await http.post(
                    target.url + spec.path, json=spec.body, headers=target.headers
                )
                result.status = response.status_code
                if response.status_code != 200:
                    result.error, code = _error_of(response.status_code, response.text)
                    result.shed = response.status_code == 503 and code == "queue_full"
                else:
                    data = response.json()
                    for choice in data.get("choices", []):
                        result.finish_reasons[choice["index"]] = choice.get("finish_reason")
                    _usage(result, data.get("usage"))
                    _check_finished(result, n_prompts * spec.n)
    except TimeoutError:
        result.error = f"no answer within {timeout_s:.0f} s"
    except httpx.HTTPError as exc:
        result.error = f"transport error: {exc!r}"
    except (ValueError, KeyError, TypeError) as exc:
        result.error = f"malformed response: {exc!r}"
    result.latency = time.perf_counter() - start
    return result


async def _stream(
    http: httpx.AsyncClient,
    target: Target,
    spec: RequestSpec,
    result: RequestResult,
    start: float,
    n_choices: int,
) -> None:
    async with http.stream(
        "POST", target.url + spec.path, json=spec.body, headers=target.headers
    ) as response:
        result.status = response.status_code
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            result.error, code = _error_of(response.status_code, text)
            result.shed = response.status_code == 503 and code == "queue_full"
            return
        if spec.disconnect in ("before_first_token", "during_prefill"):
            result.disconnect = spec.disconnect  # leaving the block hangs up
            return
        last: dict[int, float] = {}
        chunks = 0
        events = SSEEvents(response)
        async for event in events:
            if "error" in event:
                error = event["error"]
                result.error = f"error event: {error.get('code')}: {error.get('message')}"
                continue
            _usage(result, event.get("usage"))
            now = time.perf_counter()
            for choice in event.get("choices") or ():
                index = choice["index"]
                text = (
                    choice.get("text")
                    if "text" in choice
                    else (choice.get("delta") or {}).get("content")
                )
                if text:
                    chunks += 1
                    if result.ttft is None:
                        result.ttft = now - start
                    if index in last:
                        result.itls.append(now - last[index])
                    last[index] = now
                if choice.get("finish_reason"):
                    result.finish_reasons[index] = choice["finish_reason"]
            if spec.disconnect == "mid_stream" and chunks >= spec.disconnect_after:
                result.disconnect = spec.disconnect
                return
        if not events.done:
            result.error = result.error or "the stream ended without [DONE]"
        _check_finished(result, n_choices)


# ---- phases --------------------------------------------------------------------


@dataclass(slots=True)
class PhaseReport:
    """The figures of one phase."""

    name: str
    clients: int
    wall_s: float
    sent: int
    ok: int
    failed: int
    shed: int
    disconnected: int
    disconnects: dict[str, int]
    errors: dict[str, int]
    requests_per_s: float
    output_tokens_per_s: float
    prompt_tokens: int
    cached_prompt_tokens: int
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    latency_p50_s: float | None
    latency_p99_s: float | None
    peak_rss_mb: float | None = None

    @classmethod
    def of(
        cls, name: str, clients: int, wall_s: float, results: Sequence[RequestResult]
    ) -> PhaseReport:
        ok = [r for r in results if r.ok]
        errors = Counter(r.error or "?" for r in results if r.failed)
        ttfts = [r.ttft for r in ok if r.ttft is not None]
        itls = [gap for r in ok for gap in r.itls]
        latencies = [r.latency for r in ok]
        tokens = sum(r.completion_tokens for r in ok)
        wall = max(wall_s, 1e-9)
        return cls(
            name=name,
            clients=clients,
            wall_s=wall_s,
            sent=len(results),
            ok=len(ok),
            failed=sum(r.failed for r in results),
            shed=sum(r.shed for r in results),
            disconnected=sum(bool(r.disconnect) for r in results),
            disconnects=dict(Counter(r.disconnect for r in results if r.disconnect)),
            errors=dict(errors.most_common(5)),
            requests_per_s=len(ok) / wall,
            output_tokens_per_s=tokens / wall,
            prompt_tokens=sum(r.prompt_tokens for r in ok),
            cached_prompt_tokens=sum(r.cached_tokens for r in ok),
            ttft_p50_s=percentile(ttfts, 50),
            ttft_p99_s=percentile(ttfts, 99),
            itl_p50_s=percentile(itls, 50),
            itl_p99_s=percentile(itls, 99),
            latency_p50_s=percentile(latencies, 50),
            latency_p99_s=percentile(latencies, 99),
        )


def _client_http(clients: int, timeout_s: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=clients + 16, max_keepalive_connections=clients + 16)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=30.0))


async def run_clients(
    target: Target,
    workload: Workload,
    *,
    name: str = "load",
    duration_s: float | None = None,
    seed_offset: int = 0,
) -> PhaseReport:
    """``workload.clients`` closed-loop clients for ``duration_s`` (default
    ``workload.duration_s``); returns when every request they sent has ended."""
    duration = workload.duration_s if duration_s is None else duration_s
    results: list[RequestResult] = []
    start = time.monotonic()
    deadline = start + duration

    async def client(index: int, http: httpx.AsyncClient) -> None:
        factory = RequestFactory(workload, target, workload.seed * 1_000_003 + seed_offset + index)
        rng = factory.rng
        await asyncio.sleep(rng.uniform(0.0, min(workload.ramp_s, duration)))
        while time.monotonic() < deadline:
            spec = factory.make()
            results.append(await send_request(http, target, spec, workload.request_timeout_s))
            await asyncio.sleep(
                rng.expovariate(1.0 / workload.think_time_s) if workload.think_time_s > 0 else 0.0
            )

    async with _client_http(workload.clients, workload.request_timeout_s) as http:
        await asyncio.gather(*(client(i, http) for i in range(workload.clients)))
    return PhaseReport.of(name, workload.clients, time.monotonic() - start, results)


async def run_burst(
    target: Target,
    workload: Workload,
    count: int,
    *,
    name: str = "overload",
    max_tokens: int = 32,
    concurrency: int | None = None,
    seed_offset: int = 7_777,
) -> PhaseReport:
    """``count`` streaming requests sent at once (at most ``concurrency`` in
    flight, default all): past capacity some must be shed with 503."""
    factory = RequestFactory(
        dataclasses.replace(
            workload, disconnect_frac=0.0, nonstream_frac=0.0, long_prompt_frac=0.0
        ),
        target,
        workload.seed + seed_offset,
    )
    specs = []
    for _ in range(count):
        spec = factory.make()
        spec.body["max_tokens"] = min(
            spec.body["max_tokens"] + max_tokens, target.max_model_len // 2
        )
        if "prompt" in spec.body:
            spec.body["prompt"] = spec.body["prompt"][: target.max_model_len // 2 - 1]
        specs.append(spec)
    limit = asyncio.Semaphore(concurrency or count)

    async def one(spec: RequestSpec, http: httpx.AsyncClient) -> RequestResult:
        async with limit:
            return await send_request(http, target, spec, workload.request_timeout_s)

    start = time.monotonic()
    async with _client_http(concurrency or count, workload.request_timeout_s) as http:
        results = await asyncio.gather(*(one(s, http) for s in specs))
    return PhaseReport.of(name, concurrency or count, time.monotonic() - start, results)


@dataclass(slots=True)
class LoadReport:
    """Every phase, the server's state afterwards, and the verdict."""

    phases: list[PhaseReport] = field(default_factory=list)
    server: dict[str, Any] = field(default_factory=dict)
    checks: dict[str, bool] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(self.checks.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "phases": [dataclasses.asdict(p) for p in self.phases],
            "server": self.server,
            "checks": self.checks,
            "passed": self.passed,
        }

    def table(self) -> str:
        def ms(value: float | None) -> str:
            return "-" if value is None else f"{1e3 * value:.0f}"

        rows = [
            (
                "phase",
                "clients",
                "wall s",
                "sent",
                "ok",
                "failed",
                "shed",
                "hung up",
                "req/s",
                "tok/s",
                "TTFT p50/p99 ms",
                "ITL p50/p99 ms",
                "peak RSS MB",
            )
        ]
        for p in self.phases:
            rows.append(
                (
                    p.name,
                    str(p.clients),
                    f"{p.wall_s:.1f}",
                    str(p.sent),
                    str(p.ok),
                    str(p.failed),
                    str(p.shed),
                    str(p.disconnected),
                    f"{p.requests_per_s:.2f}",
                    f"{p.output_tokens_per_s:.0f}",
                    f"{ms(p.ttft_p50_s)}/{ms(p.ttft_p99_s)}",
                    f"{ms(p.itl_p50_s)}/{ms(p.itl_p99_s)}",
                    "-" if p.peak_rss_mb is None else f"{p.peak_rss_mb:.0f}",
                )
            )
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        lines.append("")
        lines += [f"server: {k} = {v}" for k, v in self.server.items()]
        lines += [f"check {'PASS' if ok else 'FAIL'}: {name}" for name, ok in self.checks.items()]
        for p in self.phases:
            for message, count in p.errors.items():
                lines.append(f"  {p.name} error x{count}: {message}")
        return "\n".join(lines)


@dataclass(slots=True)
class Plan:
    """The phases to run."""

    workload: Workload
    warmup_s: float = 0.0
    overload_burst: int = 0
    overload_max_tokens: int = 32
    recovery_requests: int = 0
    idle_timeout_s: float = 120.0
    max_rss_mb: float | None = None


async def run_load(target: Target, plan: Plan, rss: RSSMonitor | None = None) -> LoadReport:
    """Warm-up, load, overload burst and recovery against ``target``; then
    the server-side checks that ``/metrics`` allows. Bounded: every phase
    ends by itself (requests time out after ``request_timeout_s``)."""
    report = LoadReport()
    w = plan.workload

    async def phase(coro: Any) -> PhaseReport:
        since = time.monotonic()
        result = await coro
        if rss is not None:
            result.peak_rss_mb = rss.peak_mb(since)
        report.phases.append(result)
        return result

    before = await fetch_metrics(target)
    if plan.warmup_s > 0:
        warm = dataclasses.replace(w, disconnect_frac=0.0)
        await phase(
            run_clients(
                target, warm, name="warm-up", duration_s=plan.warmup_s, seed_offset=10_000_000
            )
        )
        await wait_idle(target, plan.idle_timeout_s)
    load = await phase(run_clients(target, w, name="load"))
    report.checks["load: no failed request"] = load.failed == 0 and load.sent > 0
    report.checks["load: nothing shed"] = load.shed == 0
    if plan.overload_burst > 0:
        await wait_idle(target, plan.idle_timeout_s)
        burst = await phase(
            run_burst(target, w, plan.overload_burst, max_tokens=plan.overload_max_tokens)
        )
        report.checks["overload: shed with 503 queue_full"] = burst.shed > 0
        report.checks["overload: no failure other than shedding"] = burst.failed == 0
    if plan.recovery_requests > 0:
        await wait_idle(target, plan.idle_timeout_s)
        quiet = dataclasses.replace(w, disconnect_frac=0.0, clients=min(8, w.clients))
        recovery = await phase(
            run_burst(
                target,
                quiet,
                plan.recovery_requests,
                name="recovery",
                max_tokens=8,
                concurrency=quiet.clients,
                seed_offset=99,
            )
        )
        report.checks["recovery: every request served"] = (
            recovery.ok == recovery.sent == plan.recovery_requests
        )
    after = await wait_idle(target, plan.idle_timeout_s)
    running = metric(after, "kvpage:num_requests_running")
    waiting = metric(after, "kvpage:num_requests_waiting")
    usage = metric(after, "kvpage:kv_cache_usage_perc")
    hung_up = sum(p.disconnected for p in report.phases)
    aborted = metric(after, "kvpage:request_success_total", finished_reason="abort") - metric(
        before, "kvpage:request_success_total", finished_reason="abort"
    )
    errored = metric(after, "kvpage:request_success_total", finished_reason="error") - metric(
        before, "kvpage:request_success_total", finished_reason="error"
    )
    report.server |= {
        "requests running after": int(running),
        "requests waiting after": int(waiting),
        "kv_cache_usage_perc after": usage,
        "requests aborted (server)": int(aborted),
        "client hang-ups": hung_up,
        "requests failed by the engine": int(errored),
    }
    report.checks["idle afterwards: nothing running or waiting"] = running == 0 and waiting == 0
    report.checks["every KV block back in the pool (kv_cache_usage_perc = 0)"] = usage == 0
    report.checks["no request failed inside the engine"] = errored == 0
    # a hang-up can race the request's own end, so at most one abort each
    report.checks["every abort is a client hang-up"] = aborted <= hung_up
    if rss is not None:
        peak = rss.high_water_mb() or rss.peak_mb()
        report.server["peak RSS MB"] = None if peak is None else round(peak, 1)
        if plan.max_rss_mb is not None and peak is not None:
            report.checks[f"peak RSS <= {plan.max_rss_mb:.0f} MB"] = peak <= plan.max_rss_mb
    return report


def run_against_process(server: ServerProcess, target: Target, plan: Plan) -> LoadReport:
    """``run_load`` against a spawned server, then SIGTERM it: it must exit 0
    and log that every KV block is free and the invariants hold."""
    with RSSMonitor(server.pid) as rss:
        report = asyncio.run(run_load(target, plan, rss))
        peak = rss.high_water_mb()
    if peak is not None:
        report.server["peak RSS MB"] = round(peak, 1)
    code = server.stop(signal.SIGTERM)
    log = server.log()
    report.server["exit status after SIGTERM"] = code
    report.checks["server exits 0 on SIGTERM"] = code == 0
    report.checks["server at exit: all KV blocks free, invariants hold"] = (
        "all KV blocks free, invariants hold" in log
    )
    return report


# ---- command line --------------------------------------------------------------


def _model_dir(model: str | None) -> str:
    return model or default_model_dir()


def _vocab_size(model_dir: str) -> int | None:
    try:
        return int(json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _server_info(url: str, api_key: str | None) -> tuple[str, int]:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.get(url + "/v1/models", headers=headers, timeout=30)
    response.raise_for_status()
    first = response.json()["data"][0]
    return str(first["id"]), int(first["max_model_len"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python tests/loadtest.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    d = Workload()
    target = parser.add_argument_group("server")
    target.add_argument(
        "--url", help="a running server (loopback only); default: spawn `kvpage serve` on --model"
    )
    target.add_argument("--model", help="model directory to serve (default: the tiny model)")
    target.add_argument("--model-name", help="name to send in 'model' (default: ask /v1/models)")
    target.add_argument(
        "--vocab-size",
        type=int,
        help="for token-id prompts with --url "
        "(default: from the model's config.json; without it, text prompts)",
    )
    target.add_argument("--api-key", default=None, help="API key (spawned server: set on it)")
    target.add_argument("--max-num-seqs", type=int, default=64)
    target.add_argument("--max-num-batched-tokens", type=int, default=256)
    target.add_argument("--max-model-len", type=int, default=512)
    target.add_argument(
        "--max-num-waiting",
        type=int,
        default=None,
        help="waiting-queue bound of the spawned server (default: serve's)",
    )
    target.add_argument("--startup-timeout", type=float, default=300.0)
    target.add_argument("--server-log", help="write the spawned server's log here")
    load = parser.add_argument_group("load")
    load.add_argument("--clients", type=int, default=d.clients)
    load.add_argument("--duration", type=float, default=d.duration_s, help="seconds of load")
    load.add_argument(
        "--think-time",
        type=float,
        default=d.think_time_s,
        help="mean exponential pause between a client's requests (s)",
    )
    load.add_argument("--ramp", type=float, default=d.ramp_s)
    load.add_argument("--warmup", type=float, default=20.0, help="seconds of warm-up load")
    load.add_argument("--max-tokens", type=int, nargs=2, default=d.max_tokens)
    load.add_argument("--prompt-len", type=int, nargs=2, default=d.prompt_len)
    load.add_argument("--long-prompt-len", type=int, nargs=2, default=d.long_prompt_len)
    load.add_argument("--long-prompt-frac", type=float, default=d.long_prompt_frac)
    load.add_argument("--shared-prefix-frac", type=float, default=d.shared_prefix_frac)
    load.add_argument("--n-frac", type=float, default=d.n_frac)
    load.add_argument("--chat-frac", type=float, default=d.chat_frac)
    load.add_argument("--nonstream-frac", type=float, default=d.nonstream_frac)
    load.add_argument(
        "--disconnect-frac",
        type=float,
        default=0.05,
        help="fraction of streaming requests that hang up on purpose",
    )
    load.add_argument("--request-timeout", type=float, default=d.request_timeout_s)
    load.add_argument(
        "--overload-burst",
        type=int,
        default=0,
        help="then send this many requests at once (past capacity: 503s)",
    )
    load.add_argument(
        "--recovery-requests", type=int, default=0, help="then these, which must all succeed"
    )
    load.add_argument("--max-rss-mb", type=float, default=None, help="fail above this peak")
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--json", help="also write the report here as JSON")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    workload = Workload(
        clients=args.clients,
        duration_s=args.duration,
        think_time_s=args.think_time,
        ramp_s=args.ramp,
        prompt_len=tuple(args.prompt_len),
        long_prompt_len=tuple(args.long_prompt_len),
        long_prompt_frac=args.long_prompt_frac,
        max_tokens=tuple(args.max_tokens),
        shared_prefix_frac=args.shared_prefix_frac,
        n_frac=args.n_frac,
        chat_frac=args.chat_frac,
        nonstream_frac=args.nonstream_frac,
        disconnect_frac=args.disconnect_frac,
        request_timeout_s=args.request_timeout,
        seed=args.seed,
    )
    plan = Plan(
        workload,
        warmup_s=args.warmup,
        overload_burst=args.overload_burst,
        recovery_requests=args.recovery_requests,
        max_rss_mb=args.max_rss_mb,
    )
    if args.url:
        check_loopback(args.url)
        url = args.url.rstrip("/")
        name, max_len = _server_info(url, args.api_key)
        vocab = args.vocab_size or (_vocab_size(args.model) if args.model else None)
        target = Target(url, args.model_name or name, max_len, vocab, args.api_key)
        report = asyncio.run(run_load(target, plan))
    else:
        model = _model_dir(args.model)
        engine_args = [
            "--max-num-seqs",
            str(args.max_num_seqs),
            "--max-num-batched-tokens",
            str(args.max_num_batched_tokens),
            "--max-model-len",
            str(args.max_model_len),
        ]
        if args.max_num_waiting is not None:
            engine_args += ["--max-num-waiting", str(args.max_num_waiting)]
        server = ServerProcess(model, engine_args, api_key=args.api_key, log_path=args.server_log)
        print(
            f"starting kvpage serve on {server.url} (log: {server.log_path}) ...", file=sys.stderr
        )
        try:
            server.start(args.startup_timeout)
            name, max_len = _server_info(server.url, args.api_key)
            target = Target(
                server.url, args.model_name or name, max_len, _vocab_size(model), args.api_key
            )
            print(
                f"load: {workload.clients} clients for {workload.duration_s:.0f} s "
                f"(after {plan.warmup_s:.0f} s of warm-up) ...",
                file=sys.stderr,
            )
            report = run_against_process(server, target, plan)
        finally:
            server.kill()
    print(report.table())
    if args.json:
        Path(args.json).write_text(json.dumps(report.as_dict(), indent=2))
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
