"""Faults through the whole server (uvicorn, the async engine, the engine and
the runner on the tiny random Llama), and signals.

* Clients that hang up at every point (waiting for the first token,
  mid-stream, during the prefill of a long prompt, a non-streaming one that
  gives up): each of their requests is aborted and its blocks freed; the
  other requests finish untouched.
* Non-finite logits for one request (its KV blocks are poisoned with NaN
  through the runner's ``kv_pools``) fail that request only.
* An exception inside a step fails the requests of that step only; requests
  still waiting run afterwards.
* SIGINT: the server stops accepting, lets running requests finish within
  the grace period, aborts the rest and exits 0 (SIGTERM is tested in
  ``test_server_async_engine.py``).

After each test the engine is idle, every KV block is free and its
invariants hold.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import jax.numpy as jnp
import numpy as np
import pytest
from kvpage.engine.config import EngineConfig
from kvpage.engine.llm_engine import LLMEngine
from server_harness import InProcessServer, metric, parse_metrics
from test_harden_isolation import SpyScheduler, live_blocks
from test_server_async_engine import start_fake_server, stream_completion, wait_until_streaming

KEY = "faults-key"
AUTH = {"authorization": f"Bearer {KEY}"}
MODEL = "tiny"
STEP_DELAY_S = 0.03
"""Each step is slowed down by this much, so that a client can act between
two tokens of a request."""


@pytest.fixture(scope="module")
def served(tiny_model_dir: Path) -> Iterator[InProcessServer]:
    config = EngineConfig(
        model=str(tiny_model_dir),
        max_num_seqs=8,
        max_model_len=256,
        max_num_batched_tokens=32,
        max_num_waiting=16,
    )
    with InProcessServer(config, model_name=MODEL, api_key=KEY) as server:
        yield server


@pytest.fixture
def slow_steps(served: InProcessServer) -> Iterator[None]:
    real = served.engine.engine.runner.dispatch

    def dispatch(plan: Any, prompt_targets: Any = None, token_bitmask_fn: Any = None) -> Any:
        time.sleep(STEP_DELAY_S)
        return real(plan, prompt_targets, token_bitmask_fn)

    served.call(lambda e: setattr(e.runner, "dispatch", dispatch))
    try:
        yield
    finally:
        served.call(lambda e: e.runner.__dict__.pop("dispatch", None))


def _prompt(seed: int, length: int) -> list[int]:
    return np.random.default_rng(seed).integers(16, 500, size=length).tolist()


def _finished(engine: LLMEngine) -> dict[str, int]:
    """Finished samples by reason, and aborted requests (some never had a sample)."""
    return {
        **engine.finished_counts,
        "aborted requests": engine.get_stats()["num_aborted_requests"],
    }


def _request_state(prompt: list[int]) -> Any:
    """``fn(engine)`` -> where the request with this prompt is."""

    def probe(engine: LLMEngine) -> str:
        request = next((r for r in engine._requests.values() if r.prompt_token_ids == prompt), None)
        if request is None:
            return "gone"
        if request.metrics.first_scheduled_time is None:
            return "waiting"
        return "prefilling" if request.metrics.first_token_time is None else "decoding"

    return probe


@asynccontextmanager
async def _stream(
    http: httpx.AsyncClient, served: InProcessServer, body: dict[str, Any]
) -> AsyncIterator[httpx.Response]:
    async with http.stream(
        "POST",
        served.url + "/v1/completions",
        json={"model": MODEL, "stream": True, "ignore_eos": True, "temperature": 0.0, **body},
    ) as response:
        assert response.status_code == 200
        yield response


async def _events(response: httpx.Response) -> AsyncIterator[dict[str, Any] | str]:
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            yield "[DONE]" if line == "data: [DONE]" else json.loads(line[6:])


async def _read_to_end(events: AsyncIterator[dict[str, Any] | str]) -> dict[str, Any]:
    """Finish reasons by choice, error events, usage, whether [DONE] came."""
    out: dict[str, Any] = {"finish": {}, "errors": [], "done": False, "usage": None}
    async for event in events:
        if event == "[DONE]":
            out["done"] = True
        elif "error" in event:
            out["errors"].append(event["error"]["message"])
        else:
            out["usage"] = event.get("usage") or out["usage"]
            for choice in event["choices"]:
                if choice.get("finish_reason"):
                    out["finish"][choice["index"]] = choice["finish_reason"]
    return out


def test_clients_hanging_up_anywhere_are_aborted_and_others_unharmed(
    served: InProcessServer, slow_steps: None
) -> None:
    before = served.call(_finished)
    long_prompt = _prompt(1, 220)  # 7+ steps of chunked prefill
    keepers = [
        dict(
            prompt=_prompt(10 + i, 12),
            max_tokens=24,
            n=1 + (i == 0),
            stream_options={"include_usage": True},
        )
        for i in range(4)
    ]
    seen: dict[str, Any] = {}

    async def keeper(http: httpx.AsyncClient, body: dict[str, Any]) -> dict[str, Any]:
        async with _stream(http, served, body) as response:
            return await _read_to_end(_events(response))

    async def leave_mid_stream(http: httpx.AsyncClient, seed: int) -> None:
        async with _stream(http, served, dict(prompt=_prompt(seed, 10), max_tokens=200)) as r:
            chunks = 0
            async for event in _events(r):
                chunks += isinstance(event, dict) and bool(event.get("choices"))
                if chunks == 2:
                    seen[f"mid-stream-{seed}"] = "decoding"
                    return  # leaving the block hangs up

    async def leave_before_first_token(http: httpx.AsyncClient, seed: int) -> None:
        async with _stream(http, served, dict(prompt=_prompt(seed, 40), max_tokens=200)):
            seen[f"before-first-token-{seed}"] = "no token read"

    async def leave_during_prefill(http: httpx.AsyncClient) -> None:
        async with _stream(http, served, dict(prompt=long_prompt, max_tokens=16)):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                state = await asyncio.to_thread(served.call, _request_state(long_prompt))
                if state == "prefilling":
                    seen["during-prefill"] = state
                    return
                assert state == "waiting", f"missed the prefill: {state}"
                await asyncio.sleep(0.005)

    async def leave_non_streaming(http: httpx.AsyncClient) -> None:
        with pytest.raises(httpx.ReadTimeout):
            await http.post(
                served.url + "/v1/completions",
                timeout=0.4,
                json={
                    "model": MODEL,
                    "prompt": _prompt(7, 10),
                    "max_tokens": 200,
                    "ignore_eos": True,
                },
            )
        seen["non-streaming"] = "gave up"

    async def main() -> list[Any]:
        async with httpx.AsyncClient(timeout=60, headers=AUTH) as http:
            return await asyncio.gather(
                *(keeper(http, body) for body in keepers),
                leave_mid_stream(http, 20),
                leave_mid_stream(http, 21),
                leave_before_first_token(http, 30),
                leave_before_first_token(http, 31),
                leave_during_prefill(http),
                leave_non_streaming(http),
            )

    results = asyncio.run(main())
    assert len(seen) == 6, seen
    for body, result in zip(keepers, results[:4], strict=True):
        assert result["done"] and not result["errors"], result
        assert result["finish"] == {i: "length" for i in range(body["n"])}, result
        assert result["usage"]["completion_tokens"] == 24 * body["n"]
    served.check_pool()
    after = served.call(_finished)
    assert after["aborted requests"] - before["aborted requests"] == 6
    assert after.get("error", 0) == before.get("error", 0)
    assert after.get("length", 0) - before.get("length", 0) == 5  # the keepers' samples


def test_non_finite_logits_fail_only_their_request(
    served: InProcessServer, slow_steps: None
) -> None:
    spy = SpyScheduler(served.engine.engine.scheduler)
    served.call(lambda e: setattr(e, "scheduler", spy))
    victim, others = _prompt(40, 20), [_prompt(41, 20), _prompt(42, 33)]
    before = parse_metrics(served.engine.metrics.render()[0].decode())

    def poison(engine: LLMEngine) -> int:
        """NaN into every KV block the victim holds, in every layer."""
        handle = next(r.handle for r in engine._requests.values() if r.prompt_token_ids == victim)
        plan = next(
            p for p in reversed(spy.plans) if handle in live_blocks(p, engine.runner.num_blocks)
        )
        blocks = live_blocks(plan, engine.runner.num_blocks)
        assert all(not blocks[handle] & held for h, held in blocks.items() if h != handle)
        index = jnp.asarray(sorted(blocks[handle]))
        engine.runner.kv_pools = [
            (k.at[:, index].set(jnp.nan), v.at[:, index].set(jnp.nan))
            for k, v in engine.runner.kv_pools
        ]
        return len(blocks[handle])

    async def one(
        http: httpx.AsyncClient, prompt: list[int], started: asyncio.Event, go: asyncio.Event
    ) -> dict[str, Any]:
        async with _stream(
            http, served, dict(prompt=prompt, max_tokens=60, stream_options={"include_usage": True})
        ) as r:
            events = _events(r)
            async for event in events:
                if isinstance(event, dict) and event.get("choices"):
                    break
            started.set()
            await go.wait()
            return await _read_to_end(events)

    async def main() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=60, headers=AUTH) as http:
            started = [asyncio.Event() for _ in range(3)]
            go = asyncio.Event()
            tasks = [
                asyncio.ensure_future(one(http, p, s, go))
                for p, s in zip([victim, *others], started, strict=True)
            ]
            await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 30)
            assert await asyncio.to_thread(served.call, poison) >= 2
            go.set()
            return await asyncio.gather(*tasks)

    try:
        hit, *fine = asyncio.run(main())
    finally:
        served.call(lambda e: setattr(e, "scheduler", spy.inner))
    assert hit["done"] and any("non-finite" in m for m in hit["errors"]), hit
    for result in fine:
        assert result["done"] and not result["errors"], result
        assert result["finish"] == {0: "length"} and result["usage"]["completion_tokens"] == 60
    served.check_pool()
    after = parse_metrics(served.engine.metrics.render()[0].decode())
    errors = metric(after, "kvpage:request_success_total", finished_reason="error") - metric(
        before, "kvpage:request_success_total", finished_reason="error"
    )
    assert errors == 1
    again = httpx.post(
        served.url + "/v1/completions",
        headers=AUTH,
        timeout=60,
        json={"model": MODEL, "prompt": _prompt(43, 9), "max_tokens": 5, "ignore_eos": True},
    )
    assert again.status_code == 200 and again.json()["usage"]["completion_tokens"] == 5


def test_step_exception_fails_only_the_requests_of_that_step(
    served: InProcessServer, slow_steps: None
) -> None:
    seats = 8
    fired = threading.Event()

    def arm(engine: LLMEngine) -> None:
        runner = engine.runner
        slowed = runner.dispatch

        def boom(plan: Any, prompt_targets: Any = None, token_bitmask_fn: Any = None) -> Any:
            runner.dispatch = slowed  # once, then back to the (slowed) real step
            fired.set()
            raise RuntimeError("injected step fault")

        runner.dispatch = boom

    def occupancy(engine: LLMEngine) -> tuple[int, int]:
        return engine.scheduler.num_requests_running, engine.scheduler.num_requests_waiting

    async def run(
        http: httpx.AsyncClient, prompt: list[int], max_tokens: int, started: asyncio.Event | None
    ) -> dict[str, Any]:
        async with _stream(http, served, dict(prompt=prompt, max_tokens=max_tokens)) as r:
            events = _events(r)
            if started is not None:
                async for event in events:
                    if isinstance(event, dict) and event.get("choices"):
                        break
                started.set()
            return await _read_to_end(events)

    async def main() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        async with httpx.AsyncClient(timeout=60, headers=AUTH) as http:
            started = [asyncio.Event() for _ in range(seats)]
            running = [
                asyncio.ensure_future(run(http, _prompt(60 + i, 8), 200, s))
                for i, s in enumerate(started)
            ]
            await asyncio.wait_for(asyncio.gather(*(s.wait() for s in started)), 30)
            waiting = [
                asyncio.ensure_future(run(http, _prompt(80 + i, 8), 6, None)) for i in range(2)
            ]
            deadline = time.monotonic() + 30
            while await asyncio.to_thread(served.call, occupancy) != (seats, 2):
                assert time.monotonic() < deadline, "the queue did not fill as planned"
                await asyncio.sleep(0.01)
            await asyncio.to_thread(served.call, arm)
            return await asyncio.gather(*running), await asyncio.gather(*waiting)

    failed, survived = asyncio.run(main())
    assert fired.is_set()
    for result in failed:
        assert result["done"] and any("injected step fault" in m for m in result["errors"])
    for result in survived:
        assert result["done"] and not result["errors"] and result["finish"] == {0: "length"}
    served.check_pool()


def test_sigint_drains_running_requests_and_exits_0() -> None:
    """``run_server`` on a scripted engine (no JAX) in a child process."""
    proc, url = start_fake_server()
    try:
        short: list[str] = []
        long: list[str] = []
        threads = [
            threading.Thread(target=stream_completion, args=(url, 40, short)),  # ~0.4 s
            threading.Thread(target=stream_completion, args=(url, 100_000, long)),  # past the grace
        ]
        for t in threads:
            t.start()
        wait_until_streaming(short, long)
        proc.send_signal(signal.SIGINT)
        signalled = time.monotonic()
        time.sleep(0.4)  # uvicorn checks for the signal every 0.1 s
        late: list[str] = []
        try:  # no new work is taken in: refused, or a 503
            status = httpx.post(
                url + "/v1/completions",
                timeout=5,
                json={"model": "fake-model", "prompt": [1], "max_tokens": 1},
            ).status_code
            late.append(str(status))
        except httpx.TransportError as exc:
            late.append(type(exc).__name__)
        output, _ = proc.communicate(timeout=20)
        elapsed = time.monotonic() - signalled
        for t in threads:
            t.join(10)
            assert not t.is_alive()
        assert proc.returncode == 0, output
        assert "run_server returned" in output and "KeyboardInterrupt" not in output
        assert late[0] in ("503", "ConnectError"), late
        assert short[-1] == "data: [DONE]" and '"finish_reason":"length"' in short[-2]
        assert len(short) == 40 + 1  # every token: the running request was let finish
        assert long[0].startswith("data: {"), long[:3]
        assert long[-1] == "data: [DONE]" and '"finish_reason":"abort"' in long[-2]
        assert 2.0 - 0.2 <= elapsed < 2.0 + 5.0, output  # the grace period, bounded
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
