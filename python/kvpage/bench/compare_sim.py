"""The model-free half of ``kvpage bench compare``: the seeds' worked example, static vs
continuous batching in the simulator (the real Rust scheduler, fake tokens) on a
ShareGPT-like mix, and prefix sharing counted on the real KV manager.

The half that runs the engine, the report and the command line are in
:mod:`kvpage.bench.compare`.
"""

from __future__ import annotations

import math
from dataclasses import asdict
from typing import Any

from kvpage.bench.common import log_uniform_lengths

SEEDS_OUTPUT_LENS = (32, 128, 64, 256)


# ---- lesson 1: the worked example -------------------------------------------------


def static_slot_efficiency(output_lens: list[int] | tuple[int, ...]) -> float:
    """Useful token slots / slots a static batch holds: sum / (n * max)."""
    return sum(output_lens) / (len(output_lens) * max(output_lens))


def seeds_example_sim(output_lens: tuple[int, ...] = SEEDS_OUTPUT_LENS) -> dict[str, Any]:
    """The worked example through the real scheduler (simulator): one batch
    of 4 short prompts with these output lengths, static vs fcfs."""
    from kvpage.bench.sim import simulate
    from kvpage.bench.workload import make_workload

    work = make_workload(len(output_lens), input_len=8, dist="fixed",
                         output_lens=list(output_lens), seed=0)
    out: dict[str, Any] = {
        "output_lens": list(output_lens),
        "useful_slots": sum(output_lens),
        "held_slots": len(output_lens) * max(output_lens),
        "analytic_static_efficiency": static_slot_efficiency(output_lens),
    }
    for policy in ("static", "fcfs"):
        r = simulate(work, policy=policy, num_blocks=256, max_num_seqs=len(output_lens))
        out[policy] = {"steps": r.steps, "slot_efficiency": r.slot_efficiency,
                       "output_tokens": r.output_tokens}
    return out


# ---- lesson 1: simulator at scale --------------------------------------------------


def sim_policies(
    requests: list[Any],
    *,
    num_blocks: int,
    max_model_len: int,
    max_num_seqs: int,
    block_size: int = 16,
    include_exact_static: bool = True,
) -> list[dict[str, Any]]:
    """Static (reserving prompt + max_tokens = ``max_model_len``) vs fcfs on
    ``requests`` in the simulator; optionally a static run that knows every
    output length in advance (reserves exactly prompt + output)."""
    from kvpage.bench.sim import simulate

    runs = [("static", max_model_len, "static + contiguous (reserve max_model_len)"),
            ("fcfs", max_model_len, "continuous + paged")]
    if include_exact_static:
        runs.insert(1, ("static", None, "static, lengths known (reserve exact)"))
    rows = []
    for policy, cap, label in runs:
        r = simulate(requests, policy=policy, num_blocks=num_blocks, block_size=block_size,
                     max_num_seqs=max_num_seqs, max_num_batched_tokens=max(2048, max_num_seqs),
                     max_model_len=max_model_len, max_tokens=cap)
        row = asdict(r)
        row.pop("kv_blocks_timeline")
        row["label"] = label
        row["kv_blocks_timeline"] = r.kv_blocks_timeline
        rows.append(row)
    return rows


def sim_concurrency_sweep(requests: list[Any], *, num_blocks: int, max_model_len: int,
                          levels: list[int]) -> list[dict[str, Any]]:
    """Output tokens per step vs batch width (max_num_seqs), both policies,
    same pool; static reserves ``max_model_len`` per request."""
    from kvpage.bench.sim import simulate

    rows = []
    for c in levels:
        for policy in ("static", "fcfs"):
            r = simulate(requests, policy=policy, num_blocks=num_blocks, max_num_seqs=c,
                         max_num_batched_tokens=max(2048, c), max_model_len=max_model_len,
                         max_tokens=max_model_len)
            rows.append({"policy": policy, "max_concurrency": c, "steps": r.steps,
                         "output_tokens_per_step": r.output_tokens_per_step,
                         "mean_running": r.mean_running, "preemptions": r.preemptions})
    return rows


def sharegpt_requests(num: int, seed: int = 0) -> list[Any]:
    from kvpage.bench.workload import make_workload

    return make_workload(num, input_len=230, output_len=200, dist="sharegpt", seed=seed)


def variable_requests_sim(num: int, seed: int = 0) -> list[Any]:
    from kvpage.bench.workload import make_workload

    return make_workload(num, input_len=40, range_ratio=0.6, dist="uniform", seed=seed,
                         output_lens=log_uniform_lengths(num, 20, 800, seed=seed + 1))


def waste_by_max_len(requests: list[Any], lens: tuple[int, ...] = (1024, 2048, 4096),
                     blocks_tokens: int = 1 << 17, max_num_seqs: int = 256) -> list[dict]:
    """KV waste of static+contiguous vs paged for several reservation sizes
    (max_model_len), same pool of ``blocks_tokens`` token slots."""
    from kvpage.bench.sim import simulate

    rows = []
    for max_len in lens:
        fitted = [r for r in requests if len(r.prompt_token_ids) + r.output_len <= max_len]
        row: dict[str, Any] = {"max_model_len": max_len, "requests": len(fitted)}
        for policy in ("static", "fcfs"):
            r = simulate(fitted, policy=policy, num_blocks=blocks_tokens // 16,
                         max_num_seqs=max_num_seqs, max_model_len=max_len, max_tokens=max_len)
            row[policy] = {"kv_waste": r.kv_waste, "mean_running": r.mean_running,
                           "output_tokens_per_step": r.output_tokens_per_step}
        rows.append(row)
    return rows


# ---- lesson 2: prefix sharing -------------------------------------------------------


def prefix_sharing(num_convs: int = 16, system_len: int = 200,
                   block_size: int = 16) -> dict[str, Any]:
    """Blocks holding the common system prompt of ``num_convs`` conversations:
    unshared, with forks (n > 1 style, copy-on-write) and with the radix
    prefix cache, counted on the real KV manager; plus the scheduler's view
    (one n=16 request; 16 requests arriving one after the other)."""
    import numpy as np

    from kvpage._core import KVCacheManager, Scheduler

    system = (np.arange(system_len, dtype=np.int64) * 7919) % 30000 + 10
    per_conv = math.ceil(system_len / block_size)
    pool = num_convs * (per_conv + 2) + 8

    kv = KVCacheManager(pool, block_size, enable_prefix_caching=False)
    root = kv.create_sequence()
    kv.allocate_slots(root, system_len)
    for _ in range(num_convs - 1):
        kv.fork(root)
    forked = kv.num_referenced_blocks
    kv.check_invariants()

    kv = KVCacheManager(pool, block_size, enable_prefix_caching=True)
    matched = []
    for _ in range(num_convs):
        seq = kv.create_sequence()
        hit = kv.match_prefix(seq, system)
        kv.allocate_slots(seq, system_len - hit)
        kv.cache_blocks(seq, system)
        matched.append(hit)
    cached = kv.num_referenced_blocks
    kv.check_invariants()

    # The scheduler's view: n forks of one request, and sequential requests
    # sharing the system prompt (each followed by its own user turn).
    sched = Scheduler(pool * 2, block_size, max_num_seqs=num_convs, max_model_len=4096)
    sched.add_request(system, n=num_convs, max_tokens=4, ignore_eos=True)
    plan = sched.schedule()
    sched.update(np.full(plan.num_sampled, 11, np.int32))
    n_after_prefill = sched.stats()["num_referenced_blocks"]
    plan = sched.schedule()
    copies_first_decode = len(plan.copy_src)
    sched.update(np.full(plan.num_sampled, 11, np.int32))
    n_after_decode = sched.stats()["num_referenced_blocks"]

    sched = Scheduler(pool * 4, block_size, max_num_seqs=num_convs, max_model_len=4096)
    for i in range(num_convs):
        user = np.arange(24, dtype=np.int64) + 1000 * (i + 1)
        sched.add_request(np.concatenate([system, user]), max_tokens=64, ignore_eos=True)
        plan = sched.schedule()  # admitted and prefilled before the next arrives
        sched.update(np.full(plan.num_sampled, 11, np.int32))
    stats = sched.stats()
    return {
        "conversations": num_convs,
        "system_prompt_tokens": system_len,
        "block_size": block_size,
        "unshared_blocks": num_convs * per_conv,
        "forked_blocks": forked,
        "prefix_cache_blocks": cached,
        "prefix_cache_shared_full_blocks": system_len // block_size,
        "prefix_cache_tokens_matched": matched,
        "scheduler_n_forks_blocks_after_prefill": n_after_prefill,
        "scheduler_n_forks_copy_on_write_first_decode": copies_first_decode,
        "scheduler_n_forks_blocks_after_first_decode": n_after_decode,
        "scheduler_prefix_cache_hit_blocks": stats["prefix_cache_hit_blocks"],
        "scheduler_prefix_cache_hit_tokens": stats["prefix_cache_hit_tokens"],
    }
