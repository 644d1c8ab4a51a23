"""``kvpage bench throughput``: offline throughput of the engine.

All prompts are queued at once and the engine runs them to completion;
input/output lengths are fixed, drawn uniformly (``--range-ratio``) or from a
ShareGPT-like long-tailed distribution; ``--ignore-eos`` (the default) makes
every request produce exactly its drawn output length. ``--random-weights``
runs at a real model's shape (a preset name or a ``config.json``) with random
weights, so no checkpoint is needed. Prints

    Throughput: X requests/s, Y total tokens/s, Z output tokens/s
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from kvpage.bench.common import (
    BenchRequest,
    LoadedModel,
    RunResult,
    build_engine,
    fit_to_model_len,
    format_table,
    load,
    run_requests,
    synthetic_requests,
    write_json,
)


def throughput_line(result: RunResult) -> str:
    """The one-line summary, in the format of vLLM's throughput benchmark."""
    return (
        f"Throughput: {result.requests_per_s:.2f} requests/s, "
        f"{result.total_tokens_per_s:.2f} total tokens/s, "
        f"{result.output_tokens_per_s:.2f} output tokens/s"
    )


def run_throughput(
    loaded: LoadedModel,
    config: Any,
    requests: list[BenchRequest],
    *,
    ignore_eos: bool = True,
    warmup: bool = True,
) -> tuple[RunResult, dict[str, Any]]:
    """Build an engine with ``config`` over ``loaded`` and time ``requests``.
    Returns the run and facts about the setup (warm-up time, clipping)."""
    t0 = time.perf_counter()
    engine = build_engine(loaded, config, warmup=warmup)
    setup_s = time.perf_counter() - t0
    fitted, clipped = fit_to_model_len(requests, engine.max_model_len)
    result = run_requests(engine, fitted, mode="exact" if ignore_eos else "eos", record=False)
    info = {
        "model": loaded.source,
        "engine_setup_s": setup_s,
        "warmup": warmup,
        "requests_shortened_to_max_model_len": clipped,
        "max_model_len": engine.max_model_len,
        "num_kv_blocks": engine.runner.num_blocks,
        "compilations": engine.runner.executables.num_compilations,
    }
    return result, info


def add_parser(sub: Any) -> None:
    """Add ``throughput`` to the ``kvpage bench`` subcommands."""
    from kvpage.engine.config import add_engine_args

    p = sub.add_parser(
        "throughput",
        help="offline throughput: queue every prompt at once, run to completion",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "model",
        nargs="?",
        default=None,
        help="HF model directory (default: the tiny random Llama; ignored with "
        "--random-weights)",
    )
    p.add_argument(
        "--random-weights",
        metavar="CONFIG",
        default=None,
        help="random weights at a real shape: a preset name (e.g. llama-3.2-1b, qwen3-0.6b, "
        "tiny-llama) or an HF config.json file or directory; prompts are token ids",
    )
    add_workload_args(p, num_prompts=64, input_len=128, output_len=128)
    p.add_argument(
        "--ignore-eos",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="generate exactly the drawn output length, ignoring EOS (default: on)",
    )
    add_common_args(p)
    add_engine_args(p)
    # The bench's own reading of --warmup: every bucket compiled before timing unless
    # --no-warmup (--warmup none), when compilation time counts in the result.
    p.set_defaults(func=cmd_throughput, max_model_len=None)


def add_workload_args(
    p: argparse.ArgumentParser, *, num_prompts: int, input_len: int, output_len: int
) -> None:
    """The synthetic dataset flags, shared with ``bench serve``."""
    g = p.add_argument_group("workload")
    g.add_argument(
        "--dataset",
        default="random",
        choices=["random", "sharegpt"],
        help="random: lengths fixed at --input-len/--output-len (uniform within "
        "+/- --range-ratio); sharegpt: a ShareGPT-like long-tailed draw with those means "
        "(use 230/200 for ShareGPT's averages)",
    )
    g.add_argument("--num-prompts", type=int, default=num_prompts, help="requests to send")
    g.add_argument("--input-len", type=int, default=input_len, help="prompt tokens (mean)")
    g.add_argument("--output-len", type=int, default=output_len, help="output tokens (mean)")
    g.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="random dataset: lengths uniform in mean*[1-r, 1+r] (0 = fixed)",
    )
    g.add_argument(
        "--prefix-len",
        type=int,
        default=0,
        help="tokens of one shared prefix (a system prompt) that open every prompt",
    )
    g.add_argument("--dataset-seed", type=int, default=0, help="seed of the length/token draws")


def add_common_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", metavar="PATH", default=None, help="also write the results as JSON")


def workload_from_args(
    args: argparse.Namespace, vocab_size: int, request_rate: float = float("inf")
) -> list[BenchRequest]:
    """The requests the workload flags describe (Poisson arrivals at
    ``request_rate`` per second; inf: all at once)."""
    for name in ("num_prompts", "input_len", "output_len"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if not 0.0 <= args.range_ratio < 1.0:
        raise ValueError("--range-ratio must be in [0, 1)")
    return synthetic_requests(
        args.num_prompts,
        dataset=args.dataset,
        input_len=args.input_len,
        output_len=args.output_len,
        range_ratio=args.range_ratio,
        prefix_len=args.prefix_len,
        vocab_size=vocab_size,
        seed=args.dataset_seed,
        request_rate=request_rate,
    )


def cmd_throughput(args: argparse.Namespace) -> int:
    from kvpage.engine.config import engine_config_from_args

    loaded = load(args.model, args.random_weights, dtype=args.dtype, seed=args.seed)
    config = engine_config_from_args(args, str(loaded.model_dir) if loaded.model_dir else None)
    requests = workload_from_args(args, loaded.vocab_size)
    result, info = run_throughput(
        loaded, config, requests, ignore_eos=args.ignore_eos, warmup=args.warmup != "none"
    )
    print(f"model: {info['model']}  policy: {config.scheduling_policy}  "
          f"max_num_seqs: {config.max_num_seqs}  KV blocks: {info['num_kv_blocks']} x "
          f"{config.block_size}  setup (load + warm-up): {info['engine_setup_s']:.1f} s")
    if info["requests_shortened_to_max_model_len"]:
        print(f"note: {info['requests_shortened_to_max_model_len']} requests were shortened "
              f"to fit max_model_len={info['max_model_len']}")
    print(format_table(
        ["requests", "prompt tok", "output tok", "elapsed s", "steps", "mean latency s",
         "device idle"],
        [[result.num_requests, result.prompt_tokens, result.output_tokens, result.elapsed_s,
          result.steps, result.mean_latency_s,
          f"{100 * result.timing['device_idle_fraction']:.1f}%"]],
    ))
    print(throughput_line(result))
    if args.json:
        write_json(args.json, {"command": "throughput", "setup": info,
                               "engine_config": _config_dict(config),
                               "workload": _workload_dict(args), "result": result.summary()})
    return 0


def _config_dict(config: Any) -> dict[str, Any]:
    return {name: getattr(config, name) for name in config.__slots__}


def _workload_dict(args: argparse.Namespace) -> dict[str, Any]:
    keys = ("dataset", "num_prompts", "input_len", "output_len", "range_ratio", "prefix_len",
            "dataset_seed")
    return {k: getattr(args, k) for k in keys}
