"""A model-free simulator: the real Rust scheduler, a fake token source.

It drives ``kvpage._core.Scheduler`` with a synthetic workload (arrivals,
length distributions, shared prefixes), samples random non-EOS tokens, and
reports how well the batch and the KV pool were used. Time is counted in
steps; arrivals are in steps too.

    python -m kvpage.bench.sim --policy fcfs --num-requests 200 --dist sharegpt
    python -m kvpage.bench.sim --policy static --output-lens 32,128,64,256
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

import numpy as np

from kvpage._core import Scheduler
from kvpage.bench.workload import DISTRIBUTIONS, SyntheticRequest, make_workload


@dataclass(slots=True)
class SimResult:
    """What one simulated run measured."""

    policy: str
    num_requests: int
    steps: int
    output_tokens: int
    prompt_tokens: int
    output_tokens_per_step: float
    slot_efficiency: float
    """Useful output tokens / seat-steps (``steps x max_num_seqs``), the seeds'
    definition: a static batch's finished and padded rows and an empty seat all count
    against it, for every policy."""
    seat_utilization: float
    """Rows run (static ghosts included) / seat-steps: how full the batch was."""
    idle_seats_while_waiting: int
    mean_running: float
    max_running: int
    mean_kv_usage: float
    max_kv_blocks: int
    kv_waste: float
    """Reserved-but-unused KV slots / reserved slots, averaged over steps."""
    preemptions: int
    prefix_cache_hit_rate: float
    mean_latency_steps: float
    p99_latency_steps: float
    mean_ttft_steps: float
    kv_blocks_timeline: list[int]


def simulate(
    workload: list[SyntheticRequest],
    *,
    policy: str = "fcfs",
    num_blocks: int = 4096,
    block_size: int | None = None,
    max_num_seqs: int = 64,
    max_num_batched_tokens: int | None = None,
    max_model_len: int = 4096,
    enable_prefix_caching: bool = True,
    seed: int = 0,
    max_tokens: int | None = None,
    max_steps: int = 1_000_000,
) -> SimResult:
    """Run ``workload`` to completion through the real scheduler.

    With ``max_tokens=None`` each request asks for exactly its output length
    (``ignore_eos``). With a cap, requests ask for ``max_tokens`` (as users
    do, not knowing their length) and the fake model emits EOS when a
    request reaches its drawn length, as a real model would.

    ``block_size`` and ``max_num_batched_tokens`` left as None are the engine's
    defaults (``EngineConfig``'s, which ``kvpage._core.Scheduler`` mirrors)."""
    eos = 2
    sizes = {"block_size": block_size, "max_num_batched_tokens": max_num_batched_tokens}
    sched = Scheduler(
        num_blocks,
        **{name: value for name, value in sizes.items() if value is not None},
        max_num_seqs=max_num_seqs,
        max_model_len=max_model_len,
        enable_prefix_caching=enable_prefix_caching,
        scheduling_policy=policy,
        eos_token_ids=[eos],
    )
    rng = np.random.default_rng(seed)
    pending = sorted(workload, key=lambda r: r.arrival)
    next_req = 0
    arrival_step: dict[int, float] = {}
    target_len: dict[int, int] = {}
    first_token_step: dict[int, int] = {}
    finish_step: dict[int, int] = {}
    running_hist: list[int] = []
    usage_hist: list[float] = []
    waste_hist: list[float] = []
    blocks_timeline: list[int] = []
    output_tokens = 0
    step = 0
    while next_req < len(pending) or sched.has_unfinished_requests():
        while next_req < len(pending) and pending[next_req].arrival <= step:
            req = pending[next_req]
            if max_tokens is None:
                handle = sched.add_request(
                    req.prompt_token_ids, max_tokens=req.output_len, ignore_eos=True
                )
            else:
                cap = max(1, min(max_tokens, max_model_len - len(req.prompt_token_ids)))
                handle = sched.add_request(req.prompt_token_ids, max_tokens=cap)
            target_len[handle] = req.output_len
            arrival_step[handle] = req.arrival
            next_req += 1
        plan = sched.schedule()
        sampled = rng.integers(3, 32000, size=plan.num_sampled, dtype=np.int64)
        if max_tokens is not None:
            targets = np.array(
                [target_len[h] for h in plan.sample_request.tolist()], dtype=np.int64
            )
            sampled[plan.sample_output_len + 1 >= targets] = eos
        handles, _, _, finish, _, _ = sched.update(sampled)
        step += 1
        output_tokens += len(handles)
        for h, code in zip(handles.tolist(), finish.tolist(), strict=True):
            first_token_step.setdefault(h, step)
            if code:
                finish_step[h] = step
        stats = sched.stats()
        running_hist.append(stats["last_step_seqs"])
        usage_hist.append(stats["kv_cache_usage_perc"])
        blocks_timeline.append(stats["num_referenced_blocks"])
        reserved, used = stats["kv_slots_reserved"], stats["kv_slots_used"]
        if reserved:
            waste_hist.append(1.0 - used / reserved)
        if step >= max_steps:
            raise RuntimeError(f"simulation did not finish within {max_steps} steps")
    sched.check_invariants()
    stats = sched.stats()
    rows = stats["seq_rows"]
    latencies = np.array([finish_step[h] - arrival_step[h] for h in finish_step])
    ttfts = np.array([first_token_step[h] - arrival_step[h] for h in first_token_step])
    queried = stats["prefix_cache_query_tokens"]
    return SimResult(
        policy=policy,
        num_requests=len(workload),
        steps=step,
        output_tokens=output_tokens,
        prompt_tokens=sum(len(r.prompt_token_ids) for r in workload),
        output_tokens_per_step=output_tokens / max(step, 1),
        slot_efficiency=output_tokens / max(step * max_num_seqs, 1),
        seat_utilization=rows / max(step * max_num_seqs, 1),
        idle_seats_while_waiting=stats["idle_seats_while_waiting"],
        mean_running=float(np.mean(running_hist)) if running_hist else 0.0,
        max_running=max(running_hist, default=0),
        mean_kv_usage=float(np.mean(usage_hist)) if usage_hist else 0.0,
        max_kv_blocks=max(blocks_timeline, default=0),
        kv_waste=float(np.mean(waste_hist)) if waste_hist else 0.0,
        preemptions=stats["num_preemptions"],
        prefix_cache_hit_rate=stats["prefix_cache_hit_tokens"] / queried if queried else 0.0,
        mean_latency_steps=float(latencies.mean()) if len(latencies) else 0.0,
        p99_latency_steps=float(np.percentile(latencies, 99)) if len(latencies) else 0.0,
        mean_ttft_steps=float(ttfts.mean()) if len(ttfts) else 0.0,
        kv_blocks_timeline=blocks_timeline,
    )


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m kvpage.bench.sim",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--policy",
        default="fcfs",
        choices=["fcfs", "priority", "static"],
        help="scheduling policy (static = fixed batches, max-length KV reservation)",
    )
    p.add_argument("--num-requests", type=int, default=200, help="requests in the workload")
    p.add_argument("--input-len", type=int, default=230, help="mean prompt length (tokens)")
    p.add_argument("--output-len", type=int, default=200, help="mean output length (tokens)")
    p.add_argument(
        "--dist",
        default="sharegpt",
        choices=DISTRIBUTIONS,
        help="length distribution of prompts and outputs",
    )
    p.add_argument(
        "--range-ratio", type=float, default=0.0, help="uniform lengths within mean*(1 +/- ratio)"
    )
    p.add_argument(
        "--output-lens",
        default=None,
        help="comma-separated output lengths, one per request (overrides --output-len)",
    )
    p.add_argument(
        "--shared-prefix-len",
        type=int,
        default=0,
        help="tokens of a system prompt shared by every request",
    )
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrivals per step (inf = all at once)",
    )
    p.add_argument("--num-blocks", type=int, default=4096, help="KV blocks in the pool")
    p.add_argument(
        "--block-size", type=int, default=None, help="tokens per KV block (default: the engine's)"
    )
    p.add_argument("--max-num-seqs", type=int, default=64, help="seats in the running batch")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget per step (default: the engine's)",
    )
    p.add_argument("--max-model-len", type=int, default=4096, help="longest sequence allowed")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable the prefix cache")
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="cap each request asks for; the fake model then stops at the drawn length "
        "with EOS (default: ask for exactly the drawn length)",
    )
    p.add_argument("--seed", type=int, default=0, help="workload and token seed")
    p.add_argument("--json", action="store_true", help="print the full result as JSON")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> SimResult:
    args = _parse_args(argv)
    output_lens = [int(x) for x in args.output_lens.split(",")] if args.output_lens else None
    num_requests = len(output_lens) if output_lens else args.num_requests
    workload = make_workload(
        num_requests,
        input_len=args.input_len,
        output_len=args.output_len,
        dist=args.dist if output_lens is None else "fixed",
        range_ratio=args.range_ratio,
        shared_prefix_len=args.shared_prefix_len,
        request_rate=args.request_rate,
        seed=args.seed,
        output_lens=output_lens,
    )
    result = simulate(
        workload,
        policy=args.policy,
        num_blocks=args.num_blocks,
        block_size=args.block_size,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_model_len=args.max_model_len,
        enable_prefix_caching=not args.no_prefix_caching,
        seed=args.seed,
        max_tokens=args.max_tokens,
    )
    if args.json:
        print(json.dumps(asdict(result)))
    else:
        for key, value in asdict(result).items():
            if key == "kv_blocks_timeline":
                continue
            print(f"{key:>26}: {value:.4f}" if isinstance(value, float) else f"{key:>26}: {value}")
    return result


if __name__ == "__main__":
    main()
