"""Benchmarks of the engine, in the spirit of ``vllm bench``.

    kvpage bench throughput [MODEL_DIR | --random-weights CONFIG]   offline tokens/s
    kvpage bench serve --base-url URL                               online, over HTTP
    kvpage bench scheduler                                          host cost per step
    kvpage bench host                                               full host path, no device
    kvpage bench compare                                            static vs continuous
    kvpage bench vs-hf [MODEL]                                      vs a naive HF loop
    kvpage bench step-profile [MODEL]                               where a step's time goes
    kvpage bench roofline                                           predicted H100/H200 tok/s
    kvpage bench startup [MODEL]                                    time to ready, cold and warm
    kvpage bench vs-llama-cpp [MODEL.gguf]                          vs llama.cpp's server, same file
    kvpage bench lora [MODEL]                                       LoRA: base vs adapters
    kvpage bench rollout [MODEL]                                    vs tunix's rollout (GRPO)
    kvpage bench moe                                                MoE: routed / dense / llama.cpp
    kvpage bench spec [MODEL.gguf]                                  speculative decoding off / on
    kvpage bench scaleout MODEL                                     replicas behind vllm-router

``compare`` runs the two lessons of continuous batching and PagedAttention
on the same model and workload, only the scheduling policy changed, and can
draw the README's figures (``--plot-dir``).
"""

from __future__ import annotations

import argparse
from typing import Any


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``bench`` and its subcommands to the ``kvpage`` CLI's subparsers."""
    from kvpage.bench import (
        compare,
        host,
        lora,
        moe,
        rollout,
        roofline,
        scaleout,
        scheduler,
        serve,
        spec,
        startup,
        step_profile,
        throughput,
        vs_hf,
        vs_llama_cpp,
    )

    bench = subparsers.add_parser(
        "bench",
        help="benchmarks: throughput, serve, scheduler, host, compare, vs-hf, startup, ...",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = bench.add_subparsers(dest="bench_command", required=True, metavar="BENCHMARK")
    throughput.add_parser(sub)
    serve.add_parser(sub)
    scheduler.add_parser(sub)
    host.add_parser(sub)
    compare.add_parser(sub)
    vs_hf.add_parser(sub)
    step_profile.add_parser(sub)
    roofline.add_parser(sub)
    startup.add_parser(sub)
    vs_llama_cpp.add_parser(sub)
    lora.add_parser(sub)
    rollout.add_parser(sub)
    moe.add_parser(sub)
    spec.add_parser(sub)
    scaleout.add_parser(sub)
    return bench
