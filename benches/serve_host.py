"""What the HTTP server costs per streamed token, device excluded.

The OpenAI-compatible server (``build_app`` + uvicorn, as ``kvpage serve`` runs
it) serves ``LLMEngine`` over the instant token source of ``kvpage bench host``
(:class:`kvpage.bench.host.InstantRunner`): every step costs only host work, so
what limits the server here is what limits it at very high request rates on a
fast device. A client in a separate process opens ``--streams`` streaming
``/v1/completions`` requests at once (raw sockets, so the client's own cost
stays small) of ``--output-len`` tokens each, and reads them to the end.

Printed per configuration:

- served output tokens/s (all streams' tokens / wall time from the first request
  sent to the last stream closed);
- the engine alone, same run: ``kvpage bench host``'s streaming figure at the
  same width, as tokens/s (1 / host time per sequence-step): what the server
  could stream if HTTP cost nothing; ``served / engine alone`` is the server's
  efficiency;
- CPU time of the two server threads per streamed chunk: the event loop's
  (request parsing, SSE encoding, HTTP framing, socket writes) and the engine
  thread's (steps and hand-off), and the engine's steps: requests reach the
  engine as the loop parses them, so it runs more, narrower steps than the
  output length (each step's fixed cost spread over fewer chunks).

``--http`` and ``--loop`` choose uvicorn's HTTP protocol (h11 / httptools) and
event loop (asyncio / uvloop); ``auto`` is what ``kvpage serve`` gets.

    PYTHONPATH=python python benches/serve_host.py --streams 256 1024 --output-len 64
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import sys
import threading
import time
from typing import Any

PROMPT_LEN = 16


# ---- the client (a separate process) -------------------------------------------------


async def _one_stream(port: int, body: bytes) -> tuple[float, float, int, bool]:
    """(first byte, last byte, chunks with text, ended with [DONE] after a 200)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
        b"content-type: application/json\r\nconnection: close\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )
    await writer.drain()
    parts = [await reader.read(65536)]
    first = time.perf_counter()
    while True:
        data = await reader.read(65536)
        if not data:
            break
        parts.append(data)
    last = time.perf_counter()
    writer.close()
    raw = b"".join(parts)
    ok = raw.startswith(b"HTTP/1.1 200") and b"data: [DONE]" in raw
    return first, last, raw.count(b'data: {"id"'), ok


async def _client(port: int, streams: int, output_len: int, model: str) -> dict[str, Any]:
    bodies = [
        json.dumps({
            "model": model, "prompt": [10 + (i * 31 + j) % 400 for j in range(PROMPT_LEN)],
            "max_tokens": output_len, "stream": True, "ignore_eos": True, "temperature": 0,
        }).encode()
        for i in range(streams)
    ]
    start = time.perf_counter()
    results = await asyncio.gather(*(_one_stream(port, b) for b in bodies))
    end = time.perf_counter()
    return {
        "wall_s": end - start,
        "ttft_s": sorted(r[0] - start for r in results)[len(results) // 2],
        "chunks": sum(r[2] for r in results),
        "failed": sum(not r[3] for r in results),
    }


def client_main(port: int, streams: int, output_len: int, model: str) -> None:
    print(json.dumps(asyncio.run(_client(port, streams, output_len, model))))


# ---- the server (this process) ---------------------------------------------------------


def _thread_cpu(thread: threading.Thread) -> float:
    assert thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def _run_client(port: int, streams: int, output_len: int) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, __file__, "--client", str(port), str(streams), str(output_len)],
        check=True, capture_output=True, text=True, timeout=600,
    )
    return json.loads(out.stdout)


def measure(streams: int, output_len: int, http: str, loop: str) -> dict[str, Any]:
    """Serve ``streams`` streaming requests at once; timings and thread CPU."""
    import uvicorn
    from kvpage.bench.host import HOST_MAX_MODEL_LEN, build_host_engine
    from kvpage.engine.async_engine import AsyncLLMEngine
    from kvpage.openai.app import build_app

    if PROMPT_LEN + output_len > HOST_MAX_MODEL_LEN:
        raise SystemExit(f"--output-len must be <= {HOST_MAX_MODEL_LEN - PROMPT_LEN}")
    llm_engine = build_host_engine(streams, prompt_len=PROMPT_LEN,
                                   max_model_len=HOST_MAX_MODEL_LEN)
    engine = AsyncLLMEngine(llm_engine, model_name="bench", log_stats=False)
    app = build_app(engine, served_model_name="bench")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", lifespan="off",
        http=http, loop=loop, backlog=4096, timeout_keep_alive=30,
    ))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            raise SystemExit("the server did not start")
        time.sleep(0.05)
    try:
        _run_client(port, min(streams, 32), 8)  # warm-up: first requests, first steps
        steps0 = llm_engine.counters["steps"]
        loop0, engine0 = _thread_cpu(thread), _thread_cpu(engine._thread)
        result = _run_client(port, streams, output_len)
        result["loop_cpu_s"] = _thread_cpu(thread) - loop0
        result["engine_cpu_s"] = _thread_cpu(engine._thread) - engine0
        result["steps"] = llm_engine.counters["steps"] - steps0
        return result
    finally:
        server.should_exit = True
        thread.join(10)
        engine.shutdown(5)


def engine_alone_us(streams: int) -> float:
    """``kvpage bench host``'s streaming figure: host us per sequence per step."""
    from kvpage.bench.host import measure as host_measure

    return host_measure(streams, "streaming", steps=40).us_per_seq


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--http", nargs="+", default=["auto"],
                   help="uvicorn HTTP protocols to compare: auto, h11, httptools")
    p.add_argument("--loop", nargs="+", default=["auto"],
                   help="uvicorn event loops to compare: auto, asyncio, uvloop")
    p.add_argument("--client", nargs=3, type=int, metavar=("PORT", "STREAMS", "LEN"),
                   help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.client:
        client_main(*args.client, model="bench")
        return 0
    print("| streams | http | loop | served tok/s | engine alone tok/s | served / alone "
          "| loop us/chunk | engine us/chunk | engine steps | TTFT p50 s | failed |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    failed = 0
    for streams in args.streams:
        alone = 1e6 / engine_alone_us(streams)
        for http in args.http:
            for loop in args.loop:
                r = measure(streams, args.output_len, http, loop)
                chunks = max(r["chunks"], 1)
                served = streams * args.output_len / r["wall_s"]
                failed += r["failed"]
                print(f"| {streams} | {http} | {loop} | {served:,.0f} | {alone:,.0f} "
                      f"| {served / alone:.2f} | {1e6 * r['loop_cpu_s'] / chunks:.1f} "
                      f"| {1e6 * r['engine_cpu_s'] / chunks:.1f} | {r['steps']} "
                      f"| {r['ttft_s']:.2f} "
                      f"| {r['failed']} |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
