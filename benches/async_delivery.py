"""Handing a step's outputs from the engine thread to the server's event loop.

``AsyncLLMEngine`` runs the engine on its own thread; every step's
``RequestOutput``s go to the ``RequestStream`` of each request, whose consumer
(an HTTP handler) runs on the asyncio loop. With ``--streams`` requests open,
each step delivers one output per stream; this times, per output:

* the engine thread's share (it cannot start the next step before it is done);
* end to end, until every consumer on the loop has its output.

No model and no ``LLMEngine``: the outputs are built beforehand.

    python benches/async_delivery.py [--streams 256 1024 4096] [--steps 30]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import threading
import time
from types import SimpleNamespace

from kvpage.engine.async_engine import AsyncLLMEngine, RequestStream
from kvpage.engine.config import EngineConfig
from kvpage.outputs import CompletionOutput, RequestMetrics, RequestOutput


class _NoEngine:
    """The public members of ``LLMEngine`` that building an ``AsyncLLMEngine`` reads; the
    bench never starts its engine thread."""

    config = EngineConfig()
    runner = SimpleNamespace(num_blocks=64, background_compiler=None)
    kv_cache_dtype = "auto"
    max_model_len = 1024
    counters: dict[str, int] = {}

    def step_executables_pending(self) -> int:
        return 0


def _outputs(ids: list[str], finished: bool) -> list[RequestOutput]:
    reason = "length" if finished else None
    return [
        RequestOutput(rid, None, [1, 2, 3], [CompletionOutput(0, " x", [7], finish_reason=reason)],
                      finished, RequestMetrics(arrival_time=0.0))
        for rid in ids
    ]


def measure(num_streams: int, steps: int) -> tuple[float, float]:
    """(engine-thread us per output, end-to-end us per output), medians over steps."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    engine = AsyncLLMEngine(_NoEngine(), log_stats=False, start=False)  # type: ignore[arg-type]
    ids = [f"r{i}" for i in range(num_streams)]
    received = 0
    target = 0
    arrived = threading.Event()

    async def consume(stream: RequestStream) -> None:
        nonlocal received
        async for _ in stream:
            received += 1
            if received == target:
                arrived.set()

    async def open_streams() -> None:
        for rid in ids:
            stream = RequestStream(engine, rid, loop)
            engine._streams[rid] = stream
            loop.create_task(consume(stream))

    asyncio.run_coroutine_threadsafe(open_streams(), loop).result()
    batches = [_outputs(ids, finished=step == steps) for step in range(steps + 1)]
    engine_us, total_us = [], []
    for outputs in batches:
        arrived.clear()
        target += len(outputs)
        start = time.perf_counter()
        engine._deliver(outputs)
        handed = time.perf_counter()
        if not arrived.wait(60):
            raise AssertionError("the consumers did not get every output")
        done = time.perf_counter()
        engine_us.append((handed - start) * 1e6 / len(outputs))
        total_us.append((done - start) * 1e6 / len(outputs))
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)
    return statistics.median(engine_us[1:]), statistics.median(total_us[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    print("streams  engine-thread us/output  end-to-end us/output  end-to-end ms/step")
    for n in args.streams:
        engine_us, total_us = measure(n, args.steps)
        print(f"{n:7d}  {engine_us:23.3f}  {total_us:20.3f}  {total_us * n / 1e3:18.3f}")


if __name__ == "__main__":
    main()
