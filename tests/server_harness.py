"""The server side of the load test (``tests/loadtest.py``) and the HTTP tests.

Owns how a test gets a ``kvpage serve`` to talk to and watches it: :class:`Target`
(URL, model, key), :class:`ServerProcess` (``kvpage serve`` in a child process),
:class:`InProcessServer` (the real app on a uvicorn thread of this process),
Prometheus scrapes (:func:`parse_metrics`, :func:`metric`, :func:`wait_idle`) and
:class:`RSSMonitor`. Free ports and the loopback-only rule are
:mod:`kvpage.bench.loopback`, which ``kvpage bench`` uses too. Needs ``httpx``
(``kvpage[serve]``).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from kvpage.bench.loopback import free_port


@dataclass(slots=True)
class Target:
    """The server under test."""

    url: str
    model: str
    max_model_len: int
    vocab_size: int | None = None
    """Token-id prompts need it; without it completions send text."""
    api_key: str | None = None

    @property
    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition as ``{"name{labels}": value}`` (no comments)."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                values[key] = float(value)
    return values


def metric(values: dict[str, float], name: str, **labels: str) -> float:
    """Sum of the series of ``name`` whose labels include ``labels``."""
    total = 0.0
    for key, value in values.items():
        series, _, rest = key.partition("{")
        if series != name:
            continue
        if all(f'{k}="{v}"' in rest for k, v in labels.items()):
            total += value
    return total


async def fetch_metrics(target: Target) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=30) as http:
        response = await http.get(target.url + "/metrics", headers=target.headers)
        response.raise_for_status()
        return parse_metrics(response.text)


async def wait_idle(target: Target, timeout_s: float = 60.0) -> dict[str, float]:
    """Poll ``/metrics`` until nothing runs or waits; returns the last scrape."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = await fetch_metrics(target)
        busy = metric(values, "kvpage:num_requests_running") + metric(
            values, "kvpage:num_requests_waiting"
        )
        if busy == 0 or time.monotonic() > deadline:
            return values
        await asyncio.sleep(0.2)


def _read_proc_kb(pid: int, field_name: str) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(field_name + ":"):
                return float(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


class RSSMonitor:
    """Samples a process's resident memory (Linux ``/proc``) on a thread."""

    def __init__(self, pid: int, interval_s: float = 0.25) -> None:
        self.pid = pid
        self.interval_s = interval_s
        self.samples: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-monitor", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            kb = _read_proc_kb(self.pid, "VmRSS")
            if kb is not None:
                self.samples.append((time.monotonic(), kb / 1024.0))
            self._stop.wait(self.interval_s)

    def __enter__(self) -> RSSMonitor:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def peak_mb(self, since: float = 0.0, until: float = math.inf) -> float | None:
        values = [mb for t, mb in self.samples if since <= t <= until]
        return max(values) if values else None

    def high_water_mb(self) -> float | None:
        """The kernel's peak (``VmHWM``) while the process lives."""
        kb = _read_proc_kb(self.pid, "VmHWM")
        return kb / 1024.0 if kb is not None else None


class ServerProcess:
    """``python -m kvpage.cli serve`` on 127.0.0.1 in a child process."""

    def __init__(
        self,
        model_dir: str | Path,
        engine_args: Sequence[str] = (),
        *,
        api_key: str | None = None,
        port: int | None = None,
        env: dict[str, str] | None = None,
        log_path: str | Path | None = None,
    ) -> None:
        self.model_dir = str(model_dir)
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        self.engine_args = list(engine_args)
        self.env = dict(env or {})
        self.log_path = (
            Path(log_path)
            if log_path
            else Path(tempfile.mkstemp(prefix="kvpage-serve-", suffix=".log")[1])
        )
        self.proc: subprocess.Popen[bytes] | None = None
        self.returncode: int | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def start(self, timeout_s: float = 300.0) -> None:
        env = dict(os.environ)
        python_dir = str(Path(__file__).resolve().parents[1] / "python")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (python_dir, env.get("PYTHONPATH", "")) if p)
        env.pop("KVPAGE_API_KEY", None)
        if self.api_key:
            env["KVPAGE_API_KEY"] = self.api_key  # not on the command line
        env.update(self.env)
        command = [
            sys.executable,
            "-m",
            "kvpage.cli",
            "serve",
            self.model_dir,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            *self.engine_args,
        ]
        with open(self.log_path, "wb") as log:
            # its own session: a ^C meant for the load test does not reach it
            self.proc = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"kvpage serve exited with {self.proc.returncode} while "
                    f"starting:\n{self.log()[-3000:]}"
                )
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"kvpage serve did not come up in {timeout_s:.0f} s:\n{self.log()[-3000:]}"
                )
            time.sleep(0.25)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        """Signal it and wait for it to exit; returns the exit status."""
        if self.proc is None:
            raise RuntimeError("not started")
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
        self.returncode = self.proc.returncode
        return self.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)


class InProcessServer:
    """An ``AsyncLLMEngine`` served by uvicorn on a thread of this process
    (127.0.0.1, a free port): for tests, and ``--in-process``."""

    def __init__(
        self,
        engine_config: Any,
        *,
        model_name: str = "tiny",
        api_key: str | None = None,
        **app_kwargs: Any,
    ) -> None:
        import uvicorn
        from kvpage.engine.async_engine import AsyncLLMEngine
        from kvpage.engine.llm_engine import LLMEngine
        from kvpage.openai.app import build_app

        self.model_name = model_name
        self.api_key = api_key
        self.engine = AsyncLLMEngine(
            LLMEngine.from_config(engine_config), model_name=model_name, log_stats=False
        )
        self.app = build_app(
            self.engine, served_model_name=model_name, api_key=api_key, **app_kwargs
        )
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(
            uvicorn.Config(
                self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off"
            )
        )
        self._thread = threading.Thread(target=self.server.run, name="uvicorn", daemon=True)
        self._thread.start()  # not the main thread: uvicorn installs no signal handlers
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.engine.shutdown(1)
                raise RuntimeError("the in-process server did not start")
            time.sleep(0.02)

    def target(self) -> Target:
        inner = self.engine.engine
        return Target(
            self.url,
            self.model_name,
            inner.max_model_len,
            inner.model_config.vocab_size,
            self.api_key,
        )

    def call(self, fn: Callable[[Any], Any], timeout_s: float = 60.0) -> Any:
        """``fn(llm_engine)`` on the engine thread, between steps."""
        return self.engine.submit(fn).result(timeout_s)

    def wait_idle(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """Wait until no request is left in the engine; returns ``get_stats()``."""
        deadline = time.monotonic() + timeout_s
        while True:
            stats = self.call(lambda e: e.get_stats())
            if stats["num_unfinished_requests"] == 0:
                return stats
            if time.monotonic() > deadline:
                raise AssertionError(f"the engine is not idle after {timeout_s} s: {stats}")
            time.sleep(0.05)

    def check_pool(self) -> dict[str, Any]:
        """Idle, every KV block free, invariants hold (raises otherwise)."""
        stats = self.wait_idle()
        self.call(lambda e: e.check_invariants())
        if stats["kv_cache_usage_perc"] != 0:
            raise AssertionError(f"KV blocks still held: {stats['kv_cache_usage_perc']}")
        return stats

    def close(self) -> None:
        self.server.should_exit = True
        self._thread.join(15)
        self.engine.shutdown(5)

    def __enter__(self) -> InProcessServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
