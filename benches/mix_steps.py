"""Where a concurrent ShareGPT-like mix spends its steps, engine-level (no server).

Runs ``kvpage bench vs-llama-cpp``'s highest level offline: the same requests (64
ShareGPT-like requests, seed 32 = the bench's ``--seed 0`` + level 32), 32 in flight,
each finished one replaced by the next, greedy, EOS ignored, through ``engine.step()``.
Prints generated tok/s, how many rows the steps ran against the rows their buckets
padded them to, and the wall time of the steps by size (decodes, a new prompt with the
decodes, large prefill steps).

    python benches/mix_steps.py [MODEL.gguf] [--concurrency 32] [--kv-cache-dtype auto]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

from kvpage import LLM
from kvpage.bench.common import synthetic_requests
from kvpage.model.real_models import find_or_fetch_smollm2
from kvpage.sampling.params import SamplingParams

SIZE_CLASSES = ((32, "<= 32 rows"), (127, "33-127"), (511, "128-511"), (1 << 30, ">= 512"))


def size_class(rows: int) -> str:
    return next(name for bound, name in SIZE_CLASSES if rows <= bound)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", help="a .gguf file (default: SmolLM2 Q4_1)")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--kv-cache-dtype", default="auto")
    args = parser.parse_args()
    model = args.model or str(find_or_fetch_smollm2())
    llm = LLM(model, kv_cache_dtype=args.kv_cache_dtype)
    engine = llm.engine
    level = args.concurrency
    waiting = synthetic_requests(
        2 * level, dataset="sharegpt", vocab_size=engine.model_config.vocab_size, seed=level
    )
    added = in_flight = generated = 0

    def add_next() -> None:
        nonlocal added, in_flight
        request = waiting.pop(0)
        params = SamplingParams(max_tokens=request.output_len, temperature=0.0, ignore_eos=True)
        engine.add_request(f"r{added}", {"prompt_token_ids": request.prompt_token_ids}, params)
        added += 1
        in_flight += 1

    for _ in range(level):
        add_next()
    steps: list[tuple[int, int, float]] = []  # (rows, padded rows, seconds)
    start = time.perf_counter()
    while in_flight:
        began = time.perf_counter()
        outputs = engine.step()
        seconds = time.perf_counter() - began
        rows = engine.scheduler.stats()["last_step_tokens"]
        padded = engine.runner.executables.padded_sizes(rows, 1)[0] if rows else 0
        steps.append((rows, padded, seconds))
        for output in outputs:
            if output.finished:
                in_flight -= 1
                generated += len(output.outputs[0].token_ids)
                if waiting:
                    add_next()
    total = time.perf_counter() - start
    rows = sum(r for r, _, _ in steps)
    padded = sum(p for _, p, _ in steps)
    print(f"{added} requests, {level} in flight: {generated} tokens in {total:.1f} s = "
          f"{generated / total:.1f} tok/s, {len(steps)} steps")
    print(f"rows run {rows}, padded to {padded}: {1 - rows / padded:.1%} padding")
    by_class: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0])
    for r, _, seconds in steps:
        entry = by_class[size_class(r)]
        entry[0] += 1
        entry[1] += seconds
        entry[2] += r
    for _, name in SIZE_CLASSES:
        if name in by_class:
            count, seconds, r = by_class[name]
            print(f"{name:>10}: {count:4d} steps, {seconds:6.1f} s ({seconds / total:4.0%}), "
                  f"{r:6d} rows, {1e3 * seconds / count:7.1f} ms a step")


if __name__ == "__main__":
    main()
