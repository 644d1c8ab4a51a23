"""A server's first minute: throughput from the moment ``/health`` answers.

A new user starts ``kvpage serve`` with its defaults and sends load as soon as it is
up; what they see then is the figure, not the speed after every executable is built.
This file owns that measurement, used by ``kvpage bench startup`` (time to 90 % of
steady state) and ``kvpage bench vs-llama-cpp --first-minute`` (the first-minute ratio):

* :func:`token_times`: when each output token reached the client (each streamed chunk
  counts as its request's tokens per chunk);
* :func:`time_to_fraction`: the first moment the throughput over a sliding window
  reaches a fraction of a steady-state rate;
* :func:`start_server` / :func:`serve_from_health`: a fresh server process whose load
  starts the instant it is healthy, and :func:`wait_until_compiled` (kvpage's
  ``step_executables_pending`` metric reaching 0) before a steady-state round.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvpage.bench.common import BenchRequest

WINDOW_S = 5.0
"""Throughput is taken over windows this long (sliding by 0.5 s)."""

_SERVE = "import sys; from kvpage.cli import main; sys.exit(main())"
"""``kvpage serve`` as a user starts it (``main()`` reads ``sys.argv`` and may run itself
again with the huge-page tunable, ``kvpage/system/huge_pages.py``), from this interpreter."""


def token_times(records: Sequence[Any]) -> np.ndarray:
    """Sorted ``perf_counter`` times at which output tokens reached the client."""
    times: list[float] = []
    for r in records:
        if not r.ok or not np.isfinite(r.sent) or not np.isfinite(r.ttft):
            continue
        arrivals = r.sent + r.ttft + np.concatenate([[0.0], np.cumsum(r.itls)])
        # the request's tokens spread over its chunks, in order, each counted once
        per_chunk = np.diff(np.round(np.linspace(0, r.output_tokens, len(arrivals) + 1)))
        times += np.repeat(arrivals, per_chunk.astype(int)).tolist()
    return np.sort(np.asarray(times))


def rate_at(times: np.ndarray, end: float, window: float = WINDOW_S) -> float:
    """Tokens per second over ``(end - window, end]``."""
    return float(np.searchsorted(times, end, "right") - np.searchsorted(times, end - window,
                                                                        "right")) / window


def time_to_fraction(times: np.ndarray, start: float, steady: float, fraction: float = 0.9,
                     window: float = WINDOW_S) -> float | None:
    """Seconds from ``start`` to the end of the first window whose rate is at least
    ``fraction * steady``; None if the run never gets there."""
    if len(times) == 0 or steady <= 0:
        return None
    for end in np.arange(start + window, times[-1] + 1e-9, 0.5):
        if rate_at(times, float(end), window) >= fraction * steady:
            return float(end - start)
    return None


def start_server(command: list[str], log_path: Path, env: dict[str, str] | None = None
                 ) -> subprocess.Popen[Any]:
    log = open(log_path, "wb")  # noqa: SIM115 (the child holds it; closed with the process)
    try:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
    finally:
        log.close()


def kvpage_serve_command(model: str, port: int, *extra: str) -> list[str]:
    """``kvpage serve`` as a user starts it, with its defaults (and ``extra`` flags)."""
    return [sys.executable, "-c", _SERVE, "serve", model, "--host", "127.0.0.1", "--port",
            str(port), *extra]


def stop(proc: subprocess.Popen[Any]) -> None:
    proc.terminate()
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)


def wait_health(url: str, proc: subprocess.Popen[Any], start: float) -> float:
    import httpx

    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode} before /health")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return time.perf_counter() - start
        except httpx.TransportError:
            pass
        if time.perf_counter() - start > 1800:
            raise RuntimeError("no /health within 30 minutes")
        time.sleep(0.05)


def serve_from_health(url: str, proc: subprocess.Popen[Any], requests: list[BenchRequest],
                      concurrency: int) -> dict[str, Any]:
    """Wait for ``/health``, then at once send ``requests`` (``concurrency`` in flight);
    the run's figures with its start (``health_at``, perf_counter) and token times."""
    from kvpage.bench.serve import run_requests_online, server_info, summarize

    launched = time.perf_counter()
    wait_health(url, proc, launched)
    health_at = time.perf_counter()
    model, _ = server_info(url)
    records, duration = asyncio.run(run_requests_online(
        url, requests, model=model, max_concurrency=concurrency, timeout_s=1800))
    result = summarize(records, duration, concurrency, float("inf"))
    return {"health_s": health_at - launched, "health_at": health_at,
            "output_tok_s": result.output_throughput, "failed": result.failed,
            "times": token_times(records)}


def steady_rate(url: str, requests: list[BenchRequest], concurrency: int) -> float:
    """Output tokens per second of ``requests`` on a server at full speed."""
    from kvpage.bench.serve import bench_serve

    return bench_serve(url, requests, max_concurrency=concurrency,
                       timeout_s=1800).output_throughput


def wait_until_compiled(url: str, timeout_s: float = 1800.0) -> float:
    """Seconds until kvpage's ``step_executables_pending`` metric reads 0."""
    import httpx

    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        text = httpx.get(url + "/metrics", timeout=10).text
        pending = next((float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                        if line.startswith("kvpage:step_executables_pending")), 0.0)
        if pending == 0:
            return time.perf_counter() - start
        time.sleep(1.0)
    raise RuntimeError(f"the background warm-up did not finish within {timeout_s:.0f} s")


def cache_env(cache_home: Path) -> dict[str, str]:
    """The environment of a kvpage child whose caches live under ``cache_home``."""
    env = dict(os.environ)
    env["XDG_CACHE_HOME"] = str(cache_home)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    return env
