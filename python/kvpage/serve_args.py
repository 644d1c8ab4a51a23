"""The flags of ``kvpage serve``: :func:`add_serve_args`.

One definition for the command (:mod:`kvpage.cli`) and for ``serve run kvpage.ray:app``
(:mod:`kvpage.ray.application`, which reads its arguments as these flags): the server's,
the multi-process ones (:mod:`kvpage.engine.lockstep`), Ray's and the engine's
(:func:`kvpage.engine.config.add_engine_args`).
"""

from __future__ import annotations

import argparse


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """Add every ``kvpage serve`` flag (and its MODEL argument) to ``parser``."""
    from kvpage.engine.config import add_engine_args

    parser.add_argument("model", help="HF model directory or .gguf file")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="port")
    parser.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    parser.add_argument("--public-metrics", action="store_true",
                       help="serve /metrics without the API key (it is protected by default)")
    parser.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME",
                       help="the model name(s) clients use (default: the MODEL argument)")
    parser.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                       help="LoRA adapters (PEFT directories) clients name in 'model'; "
                       "needs --enable-lora")
    parser.add_argument("--metrics-prefix", default="kvpage", choices=("kvpage", "vllm"),
                       help="Prometheus name prefix; 'vllm' serves vllm:* series, so vLLM's "
                       "Grafana dashboard and alerts work unchanged")
    parser.add_argument(
        "--kv-events-config", default=None, metavar="JSON",
        help="publish the prefix cache's stored/removed blocks for cache-aware routers "
        "(vLLM's format), e.g. '{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", "
        "\"endpoint\": \"tcp://*:5557\"}' (default: off)")
    hosts = parser.add_argument_group(
        "one model across processes (hosts): every process runs this command; process 0 "
        "serves HTTP, the others follow its steps")
    hosts.add_argument("--num-processes", type=int, default=1, metavar="P",
                       help="processes sharing the model (with --tensor-parallel-size up "
                       "to all their devices)")
    hosts.add_argument("--process-id", type=int, default=0, metavar="I",
                       help="this process's rank, 0 serving HTTP")
    hosts.add_argument("--coordinator-address", default=None, metavar="HOST:PORT",
                       help="where process 0's jax.distributed coordinator listens")
    ray = parser.add_argument_group(
        "Ray Serve (kvpage[ray]): replicas behind a router that reads their prefix caches")
    ray.add_argument("--replicas", type=int, default=None, metavar="N",
                     help="serve N engine replicas on a Ray cluster (default: one engine, "
                     "no Ray)")
    ray.add_argument("--max-replicas", type=int, default=None, metavar="M",
                     help="autoscale between --replicas and M on ongoing requests")
    ray.add_argument("--ray-address", default=None, metavar="ADDR",
                     help="the Ray cluster to join (default: RAY_ADDRESS, else a local one)")
    ray.add_argument("--router", default="kvpage", choices=("kvpage", "pow2", "prefix"),
                     help="kvpage: the replicas' cached blocks (default); pow2: Ray's "
                     "power of two choices; prefix: Ray's PrefixCacheAffinityRouter")
    ray.add_argument("--num-cpus-per-replica", type=float, default=1.0)
    ray.add_argument("--num-gpus-per-replica", type=float, default=0.0)
    ray.add_argument("--pin-cpus", action="store_true",
                     help="pin replica i to CPU i (benchmarks on one host)")
    add_engine_args(parser)


def parse_serve_args(argv: list[str]) -> argparse.Namespace:
    """``kvpage serve`` flags (``argv`` without the ``serve`` word) as parsed."""
    parser = argparse.ArgumentParser(prog="kvpage serve")
    add_serve_args(parser)
    return parser.parse_args(argv)
