"""``kvpage bench scheduler``: what the host costs per step.

1. Microseconds per scheduling step through the Python API of the Rust
   scheduler (one ``schedule()`` and one ``update()``, as the engine makes
   them) with 256, 1024 and 4096 sequences decoding, ~1k tokens of context
   each. No model: this is the scheduler's own cost.
2. Where the time of a real engine step goes, on the tiny model: device time
   (dispatch to result), the host gap between one step's result and the next
   dispatch (the device idles then), the resulting device-idle fraction, and
   the part of the wall time spent inside ``schedule()`` + ``update()``. Run
   with and without ``overlap_host_work`` (detokenizing step t while step
   t + 1 runs).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from typing import Any

import numpy as np

from kvpage.bench.common import (
    build_engine,
    format_table,
    load,
    run_requests,
    synthetic_requests,
    write_json,
)


def decoding_scheduler(running: int, context: int = 1000) -> Any:
    """A scheduler with ``running`` sequences past their prompt, decoding."""
    from kvpage._core import Scheduler

    blocks_per_seq = (context + 2048) // 16 + 2
    sched = Scheduler(
        running * blocks_per_seq,
        16,
        max_num_seqs=running,
        max_num_batched_tokens=running * (context + 24),
        max_model_len=context + 4096,
        enable_prefix_caching=False,
    )
    base = np.arange(context, dtype=np.int64)
    for r in range(running):
        sched.add_request((base + r * context) % 100_000 + 10, max_tokens=4000, ignore_eos=True)
    plan = sched.schedule()
    sched.update(np.full(plan.num_sampled, 7, np.int32))
    return sched


def time_scheduler_steps(running: int, steps: int = 200, context: int = 1000) -> dict[str, float]:
    """Median and p90 microseconds per schedule() + update() pair."""
    sched = decoding_scheduler(running, context)
    sampled = np.full(running, 7, np.int32)
    times = np.empty(steps)
    for i in range(steps):
        start = time.perf_counter()
        plan = sched.schedule()
        sched.update(sampled)
        times[i] = time.perf_counter() - start
        if plan.num_sampled != running:
            raise AssertionError(f"expected {running} decodes, got {plan.num_sampled}")
    median = float(np.median(times) * 1e6)
    return {
        "running": running,
        "median_us_per_step": median,
        "p90_us_per_step": float(np.percentile(times, 90) * 1e6),
        "ns_per_sequence": 1e3 * median / running,
    }


def add_request_rate(count: int = 20_000, prompt_len: int = 128) -> float:
    """Requests per second through ``add_request`` (no scheduling)."""
    from kvpage._core import Scheduler

    sched = Scheduler(1 << 16, 16, max_num_seqs=1024)
    prompt = np.arange(prompt_len, dtype=np.int32)
    start = time.perf_counter()
    for _ in range(count):
        sched.add_request(prompt, max_tokens=128)
    return count / (time.perf_counter() - start)


class TimedScheduler:
    """Wraps the engine's scheduler to add up the time of its calls."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.seconds = 0.0
        self.calls = 0

    def schedule(self) -> Any:
        start = time.perf_counter()
        try:
            return self._inner.schedule()
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1

    def update(self, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return self._inner.update(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def engine_host_split(
    loaded: Any,
    config: Any,
    num_requests: int = 64,
    input_len: int = 64,
    output_len: int = 64,
    seed: int = 0,
) -> dict[str, Any]:
    """Run a fixed-length workload through the engine and split its time."""
    engine = build_engine(loaded, config, warmup=True)
    timed = TimedScheduler(engine.scheduler)
    engine.scheduler = timed
    requests = synthetic_requests(
        num_requests, input_len=input_len, output_len=output_len,
        vocab_size=loaded.vocab_size, seed=seed,
    )
    result = run_requests(engine, requests, mode="exact", record=False)
    timing = result.timing
    steps = max(int(timing["steps"]), 1)
    step_ms = 1e3 * result.elapsed_s / steps
    return {
        "overlap_host_work": config.overlap_host_work,
        "max_num_seqs": config.max_num_seqs,
        "steps": int(timing["steps"]),
        "wall_ms_per_step": step_ms,
        "device_ms_per_step": timing["mean_device_ms"],
        "host_gap_ms_per_step": timing["mean_host_gap_ms"],
        "device_idle_fraction": timing["device_idle_fraction"],
        "scheduler_us_per_step": 1e6 * timed.seconds / max(timed.calls, 1),
        "scheduler_fraction_of_wall": timed.seconds / result.elapsed_s,
        "output_tokens_per_s": result.output_tokens_per_s,
    }


def add_parser(sub: Any) -> None:
    """Add ``scheduler`` to the ``kvpage bench`` subcommands."""
    from kvpage.bench.throughput import add_common_args

    p = sub.add_parser(
        "scheduler",
        help="scheduler microseconds per step; host vs device time of an engine step",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--sizes",
        default="256,1024,4096",
        help="running-sequence counts to time the bare scheduler at (default: %(default)s)",
    )
    p.add_argument("--steps", type=int, default=200, help="timed steps per size (default 200)")
    p.add_argument(
        "--context", type=int, default=1000, help="tokens of context per sequence (default 1000)"
    )
    p.add_argument(
        "--model",
        default=None,
        help="HF model directory for the engine part (default: the tiny random Llama)",
    )
    p.add_argument(
        "--num-prompts", type=int, default=64, help="engine part: requests (default 64)"
    )
    p.add_argument(
        "--input-len", type=int, default=32, help="engine part: prompt tokens (default 32)"
    )
    p.add_argument(
        "--output-len", type=int, default=128, help="engine part: output tokens (default 128)"
    )
    p.add_argument(
        "--max-num-seqs", type=int, default=64, help="engine part: batch width (default 64)"
    )
    p.add_argument(
        "--no-engine", action="store_true", help="skip the engine part (scheduler only)"
    )
    add_common_args(p)
    p.set_defaults(func=cmd_scheduler)


def cmd_scheduler(args: argparse.Namespace) -> int:
    sizes = [int(s) for s in str(args.sizes).split(",") if s.strip()]
    if not sizes or min(sizes) < 1 or args.steps < 1:
        raise ValueError("--sizes must list positive counts and --steps must be >= 1")
    rows = [time_scheduler_steps(n, args.steps, args.context) for n in sizes]
    print(format_table(
        ["running seqs", "median us/step", "p90 us/step", "ns per seq"],
        [[r["running"], r["median_us_per_step"], r["p90_us_per_step"], r["ns_per_sequence"]]
         for r in rows],
        title="Rust scheduler through the Python API: one schedule() + update() per step",
    ))
    rate = add_request_rate()
    print(f"add_request: {rate:,.0f} requests/s (128-token prompts)")
    payload: dict[str, Any] = {
        "command": "scheduler",
        "scheduler_steps": rows,
        "add_request_per_s": rate,
    }
    if not args.no_engine:
        from kvpage.engine.config import EngineConfig

        loaded = load(args.model)
        # The engine shape of `bench compare`, so its compiled steps are reused.
        base = EngineConfig(
            model=str(loaded.model_dir), max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=max(1024, args.max_num_seqs), num_gpu_blocks=1024,
            max_model_len=min(1024, loaded.model_config.max_position_embeddings),
        )
        splits = [
            engine_host_split(loaded, replace(base, overlap_host_work=overlap),
                              args.num_prompts, args.input_len, args.output_len)
            for overlap in (True, False)
        ]
        print()
        print(format_table(
            ["overlap", "steps", "wall ms/step", "device ms", "host gap ms", "device idle",
             "sched us/step", "sched % wall", "out tok/s"],
            [[s["overlap_host_work"], s["steps"], s["wall_ms_per_step"],
              s["device_ms_per_step"], s["host_gap_ms_per_step"],
              f"{100 * s['device_idle_fraction']:.1f}%", s["scheduler_us_per_step"],
              f"{100 * s['scheduler_fraction_of_wall']:.2f}%", s["output_tokens_per_s"]]
             for s in splits],
            title=f"Engine steps on {loaded.source} (CPU: the 'device' is XLA on the same cores)",
        ))
        payload["engine"] = splits
        payload["model"] = loaded.source
    if args.json:
        write_json(args.json, payload)
    return 0
