"""AsyncLLMEngine on a scripted fake engine (no JAX, fast): delivery of
deltas, aborts, idling without spinning, step failures, graceful shutdown;
and ``run_server``'s SIGTERM handling in a subprocess.

``FakeEngine`` is importable by the subprocess of ``test_sigterm_*``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from kvpage.engine.async_engine import (
    AsyncLLMEngine,
    EngineClosedError,
    RequestFailedError,
    RequestStream,
)
from kvpage.engine.config import EngineConfig
from kvpage.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvpage.sampling.params import SamplingParams


class FakeEngine:
    """Each step, every request gains one token "t" (id 7) until max_tokens. Has the
    members of ``LLMEngine`` that ``AsyncLLMEngine`` uses."""

    def __init__(self, step_s: float = 0.002) -> None:
        self.step_s = step_s
        self.config = EngineConfig()
        self.runner = SimpleNamespace(num_blocks=64, background_compiler=None)
        self.scheduler = SimpleNamespace()
        self.tokenizer = None
        self.max_model_len = 1 << 20
        self.kv_cache_dtype = "auto"
        self.counters = {"steps": 0}
        self.steps_called = 0
        self.fail_next = False
        self.threads: set[str] = set()
        self._requests: dict[str, list[Any]] = {}
        self.sink: Any = None  # set by AsyncLLMEngine
        self.hold: threading.Event | None = None
        """When set: a step hands its outputs to the sink, then waits on this event, as a
        call's text is made while the next multi-step call runs."""

    def add_request(self, request_id: str, prompt: Any, params: SamplingParams | None = None,
                    priority: int = 0, cache_salt: str | None = None, *, delta: bool = False,
                    final_only: bool = False, arrival_time: float | None = None) -> None:
        self.threads.add(threading.current_thread().name)
        assert delta != final_only, "the async engine asks for deltas or the final output"
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        max_tokens = (params or SamplingParams()).max_tokens or 16
        metrics = RequestMetrics(arrival_time=arrival_time or time.monotonic())
        self._requests[request_id] = [max_tokens, 0, metrics, final_only]

    def _output(self, request_id: str, tokens: list[int], reason: str | None) -> RequestOutput:
        metrics = self._requests[request_id][2]
        if reason is not None:
            metrics.finished_time = time.monotonic()
        return RequestOutput(request_id, None, [1, 2, 3],
                             [CompletionOutput(0, "t" * len(tokens), tokens, finish_reason=reason)],
                             reason is not None, metrics)

    def step(self) -> list[RequestOutput]:
        self.threads.add(threading.current_thread().name)
        self.steps_called += 1
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("injected step fault")
        time.sleep(self.step_s)
        self.counters["steps"] += 1
        now = time.monotonic()
        outputs = []
        for request_id, state in list(self._requests.items()):
            state[1] += 1
            metrics = state[2]
            metrics.first_scheduled_time = metrics.first_scheduled_time or now
            metrics.first_token_time = metrics.first_token_time or now
            metrics.last_token_time = now
            finished = state[1] >= state[0]
            if finished and state[3]:
                outputs.append(self._output(request_id, [7] * state[1], "length"))
            elif not state[3]:
                outputs.append(self._output(request_id, [7], "length" if finished else None))
            if finished:
                del self._requests[request_id]
        if self.hold is not None and outputs:
            if self.sink is not None:
                self.sink(outputs)
                outputs = []
            self.hold.wait(10)
        return outputs

    def set_overlapped_output_sink(self, sink: Any) -> None:
        self.sink = sink

    def abort_request(self, request_ids: str | list[str]) -> list[RequestOutput]:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        outputs = [self._output(r, [], "abort") for r in ids if r in self._requests]
        for r in ids:
            self._requests.pop(r, None)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def step_executables_pending(self) -> int:
        return 0

    def check_invariants(self) -> None:  # no KV blocks to check
        return None

    def get_stats(self) -> dict[str, Any]:
        return {"num_requests_running": len(self._requests), "num_requests_waiting": 0,
                "kv_cache_usage_perc": 0.0, "generation_tokens_total": self.counters["steps"],
                "last_step_tokens": len(self._requests)}


@pytest.fixture
def fake() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def engine(fake: FakeEngine) -> Any:
    async_engine = AsyncLLMEngine(fake, log_stats=False)
    yield async_engine
    async_engine.shutdown(1)


async def _drain(stream: Any) -> list[RequestOutput]:
    return [out async for out in stream]


def test_deltas_reach_the_stream_from_the_engine_thread(engine: AsyncLLMEngine,
                                                         fake: FakeEngine) -> None:
    async def main() -> list[RequestOutput]:
        stream = await engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=5))
        return await _drain(stream)

    outputs = asyncio.run(main())
    assert [len(o.outputs[0].token_ids) for o in outputs] == [1] * 5
    assert [o.finished for o in outputs] == [False] * 4 + [True]
    assert outputs[-1].outputs[0].finish_reason == "length"
    assert fake.threads == {"kvpage-engine"}  # the event loop never touched the engine


def test_deltas_made_during_a_call_reach_the_stream_before_it_returns(
    engine: AsyncLLMEngine, fake: FakeEngine
) -> None:
    fake.hold = threading.Event()

    async def main() -> tuple[RequestOutput, list[RequestOutput]]:
        stream = await engine.add_request("a", [1, 2, 3], SamplingParams(max_tokens=2))
        first = await asyncio.wait_for(stream.__anext__(), 5)  # the step is still held
        fake.hold.set()
        return first, await _drain(stream)

    first, rest = asyncio.run(main())
    assert first.outputs[0].token_ids == [7] and not first.finished
    assert [o.finished for o in rest] == [True]


def test_a_step_reaches_the_event_loop_in_one_call(engine: AsyncLLMEngine,
                                                   fake: FakeEngine) -> None:
    """Every stream gets every delta, in order, but the engine thread wakes the
    loop once per step, not once per output (each wake costs the engine ~12 us)."""
    wakes = 0

    async def main() -> list[list[RequestOutput]]:
        nonlocal wakes
        loop = asyncio.get_running_loop()
        original = loop.call_soon_threadsafe

        def counting(*args: Any, **kwargs: Any) -> Any:
            nonlocal wakes
            wakes += 1
            return original(*args, **kwargs)

        loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
        streams = await asyncio.gather(*(engine.add_request(f"r{i}", [1], SamplingParams(
            max_tokens=5)) for i in range(32)))
        return await asyncio.gather(*(_drain(stream) for stream in streams))

    outputs = asyncio.run(main())
    assert all([o.finished for o in outs] == [False] * 4 + [True] for outs in outputs)
    steps = fake.counters["steps"]
    assert wakes <= 32 + steps + 2, f"{wakes} wakes for 32 adds and {steps} steps"


def test_idle_engine_sleeps_instead_of_spinning(engine: AsyncLLMEngine, fake: FakeEngine) -> None:
    async def main() -> None:
        await _drain(await engine.add_request("a", [1], SamplingParams(max_tokens=3)))

    asyncio.run(main())
    time.sleep(0.05)
    steps = fake.steps_called
    time.sleep(0.3)
    assert fake.steps_called == steps == 3
    engine.submit(lambda e: None).result(5)  # still responsive after idling


def test_add_request_errors_reach_the_caller(engine: AsyncLLMEngine) -> None:
    async def main() -> None:
        stream = await engine.add_request("dup", [1], SamplingParams(max_tokens=50))
        with pytest.raises(ValueError, match="already in use"):
            await engine.add_request("dup", [1], SamplingParams(max_tokens=5))
        stream.abort()
        outputs = await _drain(stream)
        assert outputs[-1].outputs[0].finish_reason == "abort"

    asyncio.run(main())


def test_abort_from_another_thread(engine: AsyncLLMEngine, fake: FakeEngine) -> None:
    fake.step_s = 0.01

    async def main() -> list[RequestOutput]:
        stream = await engine.add_request("long", [1], SamplingParams(max_tokens=10_000))
        await stream.__anext__()
        threading.Thread(target=engine.abort, args=("long",)).start()
        return await _drain(stream)

    outputs = asyncio.run(main())
    assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
    assert len(outputs) < 1000
    assert not fake.has_unfinished_requests()


def test_step_failure_fails_requests_in_flight_and_keeps_serving(
        engine: AsyncLLMEngine, fake: FakeEngine) -> None:
    async def main() -> None:
        streams = [await engine.add_request(f"r{i}", [1], SamplingParams(max_tokens=10_000))
                   for i in range(3)]
        for stream in streams:
            await stream.__anext__()
        fake.fail_next = True
        for stream in streams:
            with pytest.raises(RequestFailedError, match="injected step fault"):
                await _drain(stream)
        outputs = await _drain(await engine.add_request("after", [1],
                                                        SamplingParams(max_tokens=2)))
        assert outputs[-1].outputs[0].finish_reason == "length"

    asyncio.run(main())
    assert engine.is_running and engine.num_failed_steps == 1
    assert not fake.has_unfinished_requests()


def test_shutdown_lets_running_requests_finish_within_grace(fake: FakeEngine) -> None:
    fake.step_s = 0.01
    engine = AsyncLLMEngine(fake, log_stats=False)
    results: dict[str, Any] = {}

    async def main() -> None:
        short = await engine.add_request("short", [1], SamplingParams(max_tokens=10))
        long = await engine.add_request("long", [1], SamplingParams(max_tokens=100_000))
        await short.__anext__()
        loop = asyncio.get_running_loop()
        stopping = loop.run_in_executor(None, engine.shutdown, 0.5)
        await asyncio.sleep(0.05)
        with pytest.raises(EngineClosedError):
            await engine.add_request("late", [1], SamplingParams(max_tokens=1))
        results["short"] = await _drain(short)
        results["long"] = await _drain(long)
        await stopping

    start = time.monotonic()
    asyncio.run(main())
    assert time.monotonic() - start < 5
    assert results["short"][-1].outputs[0].finish_reason == "length"
    assert results["long"][-1].outputs[0].finish_reason == "abort"
    assert not engine.is_running and not fake.has_unfinished_requests()
    with pytest.raises(EngineClosedError):
        engine.submit(lambda e: None).result(1)


def test_next_batch_takes_what_is_queued_and_raises_an_error_behind_it() -> None:
    def output(finished: bool) -> RequestOutput:
        return RequestOutput("x", None, [1], [CompletionOutput(0, "t", [7])], finished,
                             RequestMetrics(arrival_time=0.0))

    async def main() -> None:
        stream = RequestStream(SimpleNamespace(abort=lambda _: None), "x",
                               asyncio.get_running_loop())
        for item in (output(False), output(False), RequestFailedError("boom"), output(True)):
            stream._queue.put_nowait(item)
        assert len(await stream.next_batch()) == 2 and not stream.finished
        with pytest.raises(RequestFailedError, match="boom"):
            await stream.next_batch()
        assert stream.finished
        with pytest.raises(StopAsyncIteration):
            await stream.next_batch()

    asyncio.run(main())


async def _post_stream(app: Any, body: dict[str, Any], stall_s: float) -> list[bytes]:
    """POST ``body`` to ``app`` (ASGI, no server); the client stalls ``stall_s``
    after the first body chunk, as a slow or busy reader does. Returns the body
    chunks as sent."""
    raw = json.dumps(body).encode()
    requested = False
    chunks: list[bytes] = []

    async def receive() -> dict[str, Any]:
        nonlocal requested
        if not requested:
            requested = True
            return {"type": "http.request", "body": raw, "more_body": False}
        await asyncio.Event().wait()  # the client never leaves
        raise AssertionError("unreachable")

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            assert message["status"] == 200
        elif message.get("body"):
            chunks.append(message["body"])
            if len(chunks) == 1:
                await asyncio.sleep(stall_s)

    path = "/v1/completions"
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
             "server": ("127.0.0.1", 80), "headers": [(b"content-type", b"application/json")]}
    await app(scope, receive, send)
    return chunks


def test_a_stream_behind_the_engine_catches_up_in_one_send(engine: AsyncLLMEngine) -> None:
    """The engine makes tokens while the handler waits on its client: the tokens
    queued meanwhile go out as their own events, in order, in one send (one wake
    and one socket write for many tokens, so a busy server falls behind less)."""
    from kvpage.openai.app import build_app

    app = build_app(engine, served_model_name="fake")
    chunks = asyncio.run(_post_stream(app, {"model": "fake", "prompt": [1, 2, 3],
                                            "max_tokens": 24, "stream": True}, 0.3))
    events = b"".join(chunks).split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    texts = [json.loads(e[len(b"data: "):])["choices"][0] for e in events[:-2]]
    assert [c["text"] for c in texts] == ["t"] * 24, "one event per token, none lost"
    assert [c["finish_reason"] for c in texts] == [None] * 23 + ["length"]
    assert len(chunks) <= 3, f"{len(chunks)} sends for 24 events after a 0.3 s stall"


def test_metrics_follow_the_engine(engine: AsyncLLMEngine) -> None:
    async def main() -> None:
        await _drain(await engine.add_request("m", [1], SamplingParams(max_tokens=4)))

    asyncio.run(main())
    engine.submit(lambda e: None).result(5)
    text = engine.metrics.render()[0].decode()
    assert ('kvpage:request_success_total{engine="0",finished_reason="length",'
            'model_name="kvpage"} 1.0') in text
    assert 'kvpage:generation_tokens_total{engine="0",model_name="kvpage"} 4.0' in text
    assert 'kvpage:inter_token_latency_seconds_count{engine="0",model_name="kvpage"} 3.0' in text
    assert 'kvpage:time_to_first_token_seconds_count{engine="0",model_name="kvpage"} 1.0' in text


# ---- run_server and signals ---------------------------------------------------

_SERVE = """
import sys
sys.path.insert(0, {tests!r})
from test_server_async_engine import FakeEngine
from kvpage.engine.async_engine import AsyncLLMEngine
from kvpage.openai import run
AsyncLLMEngine.from_config = classmethod(
    lambda cls, config, **kw: cls(FakeEngine(step_s=0.01), **kw))
run.run_server("fake-model", "127.0.0.1", {port}, None, None, grace_seconds=2.0,
               log_level="warning")
print("run_server returned", flush=True)
"""


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_fake_server() -> tuple[subprocess.Popen[str], str]:
    """``run_server`` on :class:`FakeEngine` (no JAX) in a child process, once its
    ``/health`` answers; returns the process and its URL."""
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(Path(__file__).parents[2] / "python"), os.environ.get("PYTHONPATH", "")]))
    code = _SERVE.format(tests=str(Path(__file__).parent), port=port)
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 60
    try:
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    return proc, url
            except httpx.TransportError:
                time.sleep(0.1)
    except BaseException:
        proc.kill()
        proc.wait()
        raise


def stream_completion(url: str, max_tokens: int, out: list[str]) -> None:
    """Stream one completion of the fake model into ``out`` (its non-blank SSE lines, or
    the error that ended it)."""
    body = {"model": "fake-model", "prompt": [1, 2, 3], "max_tokens": max_tokens,
            "stream": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
            out.extend(line for line in response.iter_lines() if line)
    except httpx.HTTPError as exc:
        out.append(f"error: {exc!r}")


def wait_until_streaming(*outs: list[str], timeout: float = 20.0) -> None:
    """Wait until every stream in ``outs`` has its first line: the requests are running
    (a fixed sleep let a loaded machine signal before they were taken in)."""
    deadline = time.monotonic() + timeout
    while not all(outs):
        assert time.monotonic() < deadline, "the streams never started"
        time.sleep(0.01)


def test_sigterm_drains_running_requests_and_exits_0() -> None:
    proc, url = start_fake_server()
    try:
        short: list[str] = []
        long: list[str] = []
        threads = [threading.Thread(target=stream_completion, args=(url, 30, short)),  # ~0.3 s
                   threading.Thread(target=stream_completion, args=(url, 100_000, long))]
        for t in threads:
            t.start()
        wait_until_streaming(short, long)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=20)
        elapsed = time.monotonic() - signalled
        for t in threads:
            t.join(10)
            assert not t.is_alive()
        assert proc.returncode == 0, output
        assert "run_server returned" in output
        assert elapsed < 2.0 + 5.0, output
        data = [line for line in short if line]
        assert data[-1] == "data: [DONE]" and '"finish_reason":"length"' in data[-2], data[-3:]
        assert len(data) == 30 + 1  # every token arrived: the request was not cut short
        assert long[0].startswith("data: {"), long[:3]  # it was running when the signal came
        long_data = [line for line in long if line]
        assert long_data[-1] == "data: [DONE]" and '"finish_reason":"abort"' in long_data[-2]
        assert elapsed >= 2.0 - 0.2  # ... and was given the grace period
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
