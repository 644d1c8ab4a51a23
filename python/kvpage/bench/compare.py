"""``kvpage bench compare``: static batching + contiguous KV vs continuous
batching + paged KV, on the same model and workload, only the scheduling
policy changed (``static`` vs ``fcfs``); then KV sharing of a common prefix.

Lesson 1, waste. Static batching seats a batch, runs it until its longest
request ends (finished requests keep their seat as padding "ghost" rows) and
reserves each request's maximum length of KV up front, in one piece.
Continuous batching admits and evicts every step and paged KV allocates
16-token blocks on demand.

* the seeds' worked example: outputs 32, 128, 64, 256 in one static batch
  use 480 of 1024 token slots (46.9%);
* the real engine on a variable-length workload (one request wants 20
  tokens, another 800: log-uniform in [20, 800]) with the same KV pool for
  both policies; every request asks for ``max_tokens`` up to
  ``max_model_len`` and ends at its drawn length, as a model ending its
  answer with EOS would (``--length-mode cap``, see ``kvpage.bench.common``);
* the model-free simulator (the real Rust scheduler, fake tokens) at larger
  scale on a ShareGPT-like mix: KV waste, slot efficiency, sequences that fit.

Lesson 2, sharing. 16 conversations with a 200-token system prompt at block
size 16: 208 blocks unshared; forks (n > 1) share all 13 blocks; the radix
prefix cache shares the 12 full ones (the partial 13th is per conversation).

``--plot-dir DIR`` writes throughput_vs_concurrency.png and
kv_blocks_over_time.png.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import asdict
from typing import Any

from kvpage.bench.common import (
    BenchRequest,
    RunResult,
    build_engine,
    format_table,
    load,
    log_uniform_lengths,
    run_requests,
    synthetic_requests,
    write_json,
)
from kvpage.bench.compare_sim import (
    SEEDS_OUTPUT_LENS,
    prefix_sharing,
    seeds_example_sim,
    sharegpt_requests,
    sim_concurrency_sweep,
    sim_policies,
    variable_requests_sim,
    waste_by_max_len,
)

# ---- lesson 1 on the real engine ---------------------------------------------------


def variable_requests(num: int, vocab_size: int, seed: int = 0, max_prompt: int = 64,
                      low: int = 20, high: int = 800) -> list[BenchRequest]:
    """Prompts of 16-64 tokens; outputs log-uniform in [``low``, ``high``]."""
    reqs = synthetic_requests(
        num, dataset="random", input_len=40, range_ratio=0.6, vocab_size=vocab_size, seed=seed,
        output_lens=log_uniform_lengths(num, low, high, seed=seed + 1),
    )
    for r in reqs:
        del r.prompt_token_ids[max_prompt:]
    return reqs


def engine_config_for(loaded: Any, args: argparse.Namespace, policy: str) -> Any:
    """One EngineConfig for both policies; only ``scheduling_policy`` differs.

    The token budget is sized so a static batch's prompts prefill in one
    step, as padded static batching does (both policies get the same budget)."""
    from kvpage.engine.config import EngineConfig

    max_len = min(args.max_model_len, loaded.model_config.max_position_embeddings)
    static_seats = min(args.max_num_seqs, args.num_gpu_blocks * 16 // max_len)
    budget = 1 << math.ceil(math.log2(max(256, static_seats * 64, args.max_num_seqs)))
    return EngineConfig(
        model=str(loaded.model_dir) if loaded.model_dir else None,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=budget,
        block_size=16,
        num_gpu_blocks=args.num_gpu_blocks,
        max_model_len=max_len,
        scheduling_policy=policy,
        seed=0,
    )


def _progress(message: str) -> None:
    print(f"[compare] {message}", file=sys.stderr, flush=True)


def run_engine_part(loaded: Any, args: argparse.Namespace) -> dict[str, Any]:
    """The worked example, the variable-length workload and the concurrency
    sweep on the real engine, one warmed-up engine per policy."""
    engines = {}
    setup = {}
    for policy in ("static", "fcfs"):
        t0 = time.perf_counter()
        engines[policy] = build_engine(loaded, engine_config_for(loaded, args, policy))
        setup[policy] = time.perf_counter() - t0
        _progress(f"{policy} engine ready (load + warm-up {setup[policy]:.1f} s)")
    out: dict[str, Any] = {"engine_setup_s": setup,
                           "engine_config": _config_dict(engines["fcfs"].config)}

    seeds = [BenchRequest(list(range(10, 26)), n) for n in SEEDS_OUTPUT_LENS]
    out["seeds_example"] = {
        p: run_requests(engines[p], seeds, mode="exact").summary() for p in engines
    }

    requests = variable_requests(args.num_requests, loaded.vocab_size, seed=args.seed)
    runs: dict[str, RunResult] = {}
    for policy in ("fcfs", "static"):
        runs[policy] = run_requests(engines[policy], requests, mode=args.length_mode,
                                    time_limit_s=args.time_limit)
        _progress(f"variable-length workload, {policy}: {runs[policy].elapsed_s:.1f} s, "
                  f"{runs[policy].steps} steps")
    out["variable"] = {p: asdict(r) for p, r in runs.items()}

    sweep = []
    sweep_requests = requests[: args.sweep_requests]
    for c in args.concurrency:
        for policy in ("fcfs", "static"):
            r = run_requests(engines[policy], sweep_requests, mode=args.length_mode,
                             max_concurrency=c, record=True, time_limit_s=args.time_limit)
            sweep.append({"policy": policy, "max_concurrency": c, "num_requests": r.num_requests,
                          "output_tokens_per_s": r.output_tokens_per_s,
                          "requests_per_s": r.requests_per_s, "steps": r.steps,
                          "output_tokens_per_step": r.output_tokens / max(r.steps, 1),
                          "mean_running": r.mean_running, "elapsed_s": r.elapsed_s})
            _progress(f"sweep, concurrency {c}, {policy}: {r.elapsed_s:.1f} s")
    out["concurrency_sweep"] = sweep
    return out


def _config_dict(config: Any) -> dict[str, Any]:
    return {name: getattr(config, name) for name in config.__slots__}


# ---- reporting -------------------------------------------------------------------


def _pct(x: float) -> str:
    return "-" if x != x else f"{100 * x:.1f}%"


def print_report(result: dict[str, Any]) -> None:
    seeds = result["seeds_sim"]
    print(format_table(
        ["run", "steps", "slot efficiency"],
        [["analytic: sum/(n*max) = "
          f"{seeds['useful_slots']}/{seeds['held_slots']}", "-",
          _pct(seeds["analytic_static_efficiency"])],
         ["simulator static", seeds["static"]["steps"], _pct(seeds["static"]["slot_efficiency"])],
         ["simulator fcfs", seeds["fcfs"]["steps"], _pct(seeds["fcfs"]["slot_efficiency"])]]
        + ([[f"engine {p}", r["steps"], _pct(r["slot_efficiency"])]
            for p, r in result["engine"]["seeds_example"].items()]
           if "engine" in result else []),
        title="1a. Worked example: one batch with outputs 32, 128, 64, 256 tokens",
    ))
    if "engine" in result:
        eng = result["engine"]
        runs = eng["variable"]
        cfg = eng["engine_config"]
        s, f = runs["static"], runs["fcfs"]
        print()
        print(format_table(
            ["policy", "req/s", "out tok/s", "steps", "out tok/step", "slot eff", "seat util",
             "KV waste", "mean seqs", "max seqs", "mean lat s", "p99 lat s", "exact len"],
            [[label, r["requests_per_s"], r["output_tokens_per_s"], r["steps"],
              r["output_tokens"] / max(r["steps"], 1), _pct(r["slot_efficiency"]),
              _pct(r["seat_utilization"]), _pct(r["kv_waste"]), r["mean_running"],
              r["max_running"], r["mean_latency_s"],
              r["p99_latency_s"], f"{r['lengths_as_drawn']}/{r['num_requests']}"]
             for label, r in (("static + contiguous", s), ("continuous + paged", f))],
            title=(f"1b. Real engine, {s['num_requests']} requests, outputs 20..800 "
                   f"(log-uniform), same KV pool: {cfg['num_gpu_blocks']} blocks x 16 = "
                   f"{cfg['num_gpu_blocks'] * 16} token slots, max_model_len "
                   f"{cfg['max_model_len']}, max_num_seqs {cfg['max_num_seqs']}"),
        ))
        print(f"continuous/static: {f['output_tokens_per_s'] / s['output_tokens_per_s']:.2f}x "
              f"output tokens/s (wall clock), {s['steps'] / max(f['steps'], 1):.2f}x fewer "
              "steps")
        print()
        print(format_table(
            ["max concurrency", "policy", "out tok/s", "steps", "out tok/step", "mean seqs"],
            [[r["max_concurrency"], r["policy"], r["output_tokens_per_s"], r["steps"],
              r["output_tokens_per_step"], r["mean_running"]] for r in eng["concurrency_sweep"]],
            title="1c. Throughput vs client concurrency (real engine, same KV pool)",
        ))
    for key, title in (("sim_sharegpt", "1d. Simulator, ShareGPT-like mix"),
                       ("sim_variable", "1e. Simulator, outputs 20..800 (log-uniform)")):
        rows = result[key]["runs"]
        meta = result[key]
        print()
        print(format_table(
            ["policy", "steps", "out tok/step", "slot eff", "seat util", "KV waste",
             "mean seqs", "max seqs", "preempt", "mean lat steps", "p99 lat steps"],
            [[r["label"], r["steps"], r["output_tokens_per_step"], _pct(r["slot_efficiency"]),
              _pct(r["seat_utilization"]), _pct(r["kv_waste"]), r["mean_running"],
              r["max_running"], r["preemptions"],
              r["mean_latency_steps"], r["p99_latency_steps"]] for r in rows],
            title=(f"{title}: {meta['num_requests']} requests, {meta['num_blocks']} blocks x 16, "
                   f"max_model_len {meta['max_model_len']}, max_num_seqs {meta['max_num_seqs']}"),
        ))
    sweep = result["sim_variable"]["concurrency_sweep"]
    print()
    print(format_table(
        ["max_num_seqs", "static tok/step", "paged tok/step", "ratio", "static seqs",
         "paged seqs", "paged preempt"],
        [[a["max_concurrency"], a["output_tokens_per_step"], b["output_tokens_per_step"],
          b["output_tokens_per_step"] / a["output_tokens_per_step"], a["mean_running"],
          b["mean_running"], b["preemptions"]]
         for a, b in zip(sweep[::2], sweep[1::2], strict=True)],
        title="1g. Simulator, outputs 20..800: output tokens per step vs batch width, "
              f"{result['sim_variable']['num_blocks']} blocks for both",
    ))
    print()
    print(format_table(
        ["reserve to (max_model_len)", "static KV waste", "paged KV waste", "static mean seqs",
         "paged mean seqs"],
        [[r["max_model_len"], _pct(r["static"]["kv_waste"]), _pct(r["fcfs"]["kv_waste"]),
          r["static"]["mean_running"], r["fcfs"]["mean_running"]]
         for r in result["waste_by_max_len"]],
        title="1f. ShareGPT-like mix: KV waste vs the length contiguous KV reserves",
    ))
    p = result["prefix_sharing"]
    print()
    print(format_table(
        ["sharing", "blocks", "note"],
        [["none", p["unshared_blocks"], f"{p['conversations']} x ceil(200/16)"],
         ["forks (n > 1)", p["forked_blocks"], "all 13 blocks, copy-on-write"],
         ["radix prefix cache", p["prefix_cache_blocks"],
          f"{p['prefix_cache_shared_full_blocks']} full blocks shared + 1 partial each"],
         ["scheduler, n=16 after prefill", p["scheduler_n_forks_blocks_after_prefill"], ""],
         ["scheduler, n=16 after 1st decode", p["scheduler_n_forks_blocks_after_first_decode"],
          f"{p['scheduler_n_forks_copy_on_write_first_decode']} copy-on-write copies"],
         ["scheduler, 16 sequential requests", "-",
          f"{p['scheduler_prefix_cache_hit_blocks']} blocks hit in the prefix cache"]],
        title=f"2. {p['conversations']} conversations, {p['system_prompt_tokens']}-token "
              f"system prompt, block size {p['block_size']}",
    ))


# ---- the command -------------------------------------------------------------------


def run_compare(args: argparse.Namespace) -> dict[str, Any]:
    """Everything ``compare`` measures, as one JSON-able dict."""
    result: dict[str, Any] = {"command": "compare", "seeds_sim": seeds_example_sim()}
    sg = sharegpt_requests(args.sim_requests, seed=args.seed)
    result["sim_sharegpt"] = {
        "num_requests": len(sg), "num_blocks": args.sim_blocks, "max_model_len": 2048,
        "max_num_seqs": 256,
        "runs": sim_policies([r for r in sg if len(r.prompt_token_ids) + r.output_len <= 2048],
                             num_blocks=args.sim_blocks, max_model_len=2048, max_num_seqs=256),
    }
    var = variable_requests_sim(args.sim_requests, seed=args.seed)
    result["sim_variable"] = {
        "num_requests": len(var), "num_blocks": args.num_gpu_blocks, "max_model_len": 1024,
        "max_num_seqs": args.max_num_seqs,
        "runs": sim_policies(var, num_blocks=args.num_gpu_blocks, max_model_len=1024,
                             max_num_seqs=args.max_num_seqs),
    }
    result["sim_variable"]["concurrency_sweep"] = sim_concurrency_sweep(
        var, num_blocks=args.num_gpu_blocks, max_model_len=1024, levels=args.sim_concurrency)
    result["waste_by_max_len"] = waste_by_max_len(sg)
    result["prefix_sharing"] = prefix_sharing()
    if args.engine:
        loaded = load(args.model)
        result["model"] = loaded.source
        result["engine"] = run_engine_part(loaded, args)
    return result


def add_parser(sub: Any) -> None:
    """Add ``compare`` to the ``kvpage bench`` subcommands."""
    from kvpage.bench.common import LENGTH_MODES
    from kvpage.bench.throughput import add_common_args

    p = sub.add_parser(
        "compare",
        help="static + contiguous KV vs continuous + paged KV; prefix sharing; plots",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=None,
                   help="HF model directory for the engine runs (default: the tiny random Llama)")
    p.add_argument("--engine", action=argparse.BooleanOptionalAction, default=True,
                   help="run the real engine parts (default: on; off = simulator and KV "
                   "manager only, seconds)")
    p.add_argument("--num-requests", type=int, default=128,
                   help="engine: requests of the variable-length workload (default 128)")
    p.add_argument("--num-gpu-blocks", type=int, default=1024,
                   help="KV blocks of 16 tokens, the same for both policies (default 1024 = "
                   "16 sequences of 1024 tokens)")
    p.add_argument("--max-num-seqs", type=int, default=64,
                   help="batch width of both policies (default 64)")
    p.add_argument("--max-model-len", type=int, default=1024,
                   help="longest sequence; static reserves this much per request in "
                   "--length-mode cap (default 1024)")
    p.add_argument("--length-mode", default="cap", choices=LENGTH_MODES,
                   help="cap (default): ask for max_tokens up to max_model_len, end at the drawn "
                   "length; exact: max_tokens = drawn length + ignore_eos (static then "
                   "reserves exactly what is used); eos: drawn length as max_tokens, EOS allowed")
    p.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")],
                   default=[4, 16, 64],
                   help="engine: client-side concurrency levels of the sweep (default 4,16,64)")
    p.add_argument("--sim-concurrency", type=lambda s: [int(x) for x in s.split(",")],
                   default=[4, 8, 16, 32, 64, 128, 256],
                   help="simulator: batch widths of its sweep (default 4,8,...,256)")
    p.add_argument("--sweep-requests", type=int, default=64,
                   help="engine: requests per point of the concurrency sweep (default 64)")
    p.add_argument("--sim-requests", type=int, default=1000,
                   help="simulator: requests per workload (default 1000)")
    p.add_argument("--sim-blocks", type=int, default=8192,
                   help="simulator, ShareGPT-like mix: KV blocks of 16 tokens (default 8192)")
    p.add_argument("--time-limit", type=float, default=600.0,
                   help="engine: seconds one run may take before it is abandoned (default 600)")
    p.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    p.add_argument("--plot-dir", default=None,
                   help="write throughput_vs_concurrency.png and kv_blocks_over_time.png here")
    add_common_args(p)
    p.set_defaults(func=cmd_compare)


def cmd_compare(args: argparse.Namespace) -> int:
    for name in ("num_requests", "num_gpu_blocks", "max_num_seqs", "max_model_len",
                 "sweep_requests", "sim_requests", "sim_blocks"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.num_gpu_blocks * 16 < args.max_model_len:
        raise ValueError("--num-gpu-blocks must hold at least one max_model_len sequence")
    result = run_compare(args)
    print_report(result)
    if args.plot_dir:
        from kvpage.bench.plots import write_plots

        for path in write_plots(result, args.plot_dir):
            print(f"wrote {path}")
    if args.json:
        write_json(args.json, _without_timelines(result))
    return 0


def _without_timelines(result: dict[str, Any]) -> dict[str, Any]:
    """The result with long per-step series thinned to at most 500 points."""

    def thin(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: thin(v) for k, v in value.items()}
        if isinstance(value, list):
            if len(value) > 500 and all(isinstance(x, int | float) for x in value[:10]):
                stride = math.ceil(len(value) / 500)
                return value[::stride]
            return [thin(v) for v in value]
        return value

    return thin(result)
