"""Scheduler steps through the Python binding: one schedule() and one
update() call per step, as the engine makes them, at 256/1024/4096 running
sequences with ~1k tokens of context each; plus add_request throughput.

    python3 benches/scheduler_binding.py [--steps 200]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from kvpage._core import Scheduler


def decoding_scheduler(running: int) -> Scheduler:
    sched = Scheduler(
        running * 80,
        16,
        max_num_seqs=running,
        max_num_batched_tokens=running * 1024,
        max_model_len=4096,
    )
    for r in range(running):
        prompt = (np.arange(1000, dtype=np.int64) + r * 1000) % 100_000
        sched.add_request(prompt, max_tokens=3000, ignore_eos=True)
    plan = sched.schedule()
    sched.update(np.full(plan.num_sampled, 5, np.int32))
    return sched


def time_steps(running: int, steps: int) -> float:
    """Median microseconds per schedule() + update() pair."""
    sched = decoding_scheduler(running)
    sampled = np.full(running, 5, np.int32)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        plan = sched.schedule()
        sched.update(sampled)
        times.append(time.perf_counter() - start)
        assert plan.num_sampled == running
    return float(np.median(times) * 1e6)


def time_add_request(count: int = 20_000) -> float:
    """Requests per second through add_request (128-token prompts)."""
    sched = Scheduler(1 << 16, 16, max_num_seqs=1024)
    prompt = np.arange(128, dtype=np.int32)
    start = time.perf_counter()
    for _ in range(count):
        sched.add_request(prompt, max_tokens=128)
    return count / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=200, help="timed steps per size")
    args = parser.parse_args()
    print(f"{'running':>8} {'us/step (schedule+update)':>28}")
    for running in (256, 1024, 4096):
        print(f"{running:>8} {time_steps(running, args.steps):>28.1f}")
    print(f"add_request: {time_add_request():,.0f} requests/s")


if __name__ == "__main__":
    main()
