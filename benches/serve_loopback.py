"""``kvpage bench serve`` against an in-process server, in one command.

Starts the OpenAI-compatible server on a free loopback port (uvicorn in a
thread) over the given model (default: the tiny random Llama), runs the
serving benchmark against it, prints the result block and stops the server.

    PYTHONPATH=python python benches/serve_loopback.py --num-prompts 64 \\
        --dataset sharegpt --input-len 230 --output-len 200 --request-rate 8
"""

from __future__ import annotations

import argparse
import socket
import sys
import threading
import time

from kvpage.bench.common import (
    default_model_dir,
    synthetic_requests,
)
from kvpage.bench.serve import bench_serve, format_result


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF model directory (default: tiny Llama)")
    p.add_argument("--dataset", default="sharegpt", choices=["random", "sharegpt"],
                   help="length distribution (default: sharegpt)")
    p.add_argument("--num-prompts", type=int, default=64, help="requests (default 64)")
    p.add_argument("--input-len", type=int, default=230, help="mean prompt tokens")
    p.add_argument("--output-len", type=int, default=200, help="mean output tokens")
    p.add_argument("--range-ratio", type=float, default=0.0, help="random: +/- fraction")
    p.add_argument("--prefix-len", type=int, default=0, help="shared prefix tokens")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="Poisson arrivals per second (default inf)")
    p.add_argument("--max-concurrency", type=int, default=None, help="requests in flight")
    p.add_argument("--max-num-seqs", type=int, default=32, help="server batch width")
    p.add_argument("--max-model-len", type=int, default=1024, help="server max_model_len")
    p.add_argument("--num-gpu-blocks", type=int, default=1024,
                   help="server KV blocks (default 1024, the shape `bench compare` uses)")
    p.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "static"],
                   help="server scheduling policy")
    args = p.parse_args()

    import uvicorn
    from kvpage.engine.async_engine import AsyncLLMEngine
    from kvpage.engine.config import EngineConfig
    from kvpage.engine.llm_engine import LLMEngine
    from kvpage.openai.app import build_app

    model = args.model or default_model_dir()
    config = EngineConfig(model=model, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=max(1024, args.max_num_seqs),
                          max_model_len=args.max_model_len,
                          num_gpu_blocks=args.num_gpu_blocks,
                          scheduling_policy=args.scheduling_policy)
    llm_engine = LLMEngine.from_config(config)
    llm_engine.runner.warmup(progress=False, max_workers=2)
    engine = AsyncLLMEngine(llm_engine, model_name="bench", log_stats=False)
    app = build_app(engine, served_model_name="bench")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        if not thread.is_alive():
            return 1
        time.sleep(0.05)
    try:
        requests = synthetic_requests(
            args.num_prompts, dataset=args.dataset, input_len=args.input_len,
            output_len=args.output_len, range_ratio=args.range_ratio,
            prefix_len=args.prefix_len, vocab_size=500, request_rate=args.request_rate,
        )
        result = bench_serve(f"http://127.0.0.1:{port}", requests,
                             max_concurrency=args.max_concurrency,
                             request_rate=args.request_rate)
        print(format_result(result))
        return 0 if result.failed == 0 else 1
    finally:
        server.should_exit = True
        thread.join(10)
        engine.shutdown(5)


if __name__ == "__main__":
    sys.exit(main())
