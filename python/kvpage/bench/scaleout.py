"""``kvpage bench scaleout``: replicas behind a gateway, routed by what each one caches.

In one run, on one model, with each replica a ``kvpage serve`` process pinned to its own
CPU (``taskset``) and publishing its KV-cache events (``--kv-events-config``), the same
shared-prefix workload goes through:

* one replica alone with every CPU and the replicas' KV pools together, which sees every
  request (the prefix-cache hit rate to match);
* ``vllm-router --policy round_robin`` over ``--replicas`` replicas;
* ``vllm-router --policy cache_aware`` (the gateway's default: a prefix tree of the
  requests it has routed, guessed from their tokens);
* ``vllm-router --policy kv_aware`` fed by the replicas' events: it routes on what each
  replica actually holds, evictions included;
* the same replicas on Ray Serve (``kvpage serve --replicas N --pin-cpus``, a local Ray
  cluster) with kvpage's router (the engines' cached block hashes, :mod:`kvpage.ray`),
  Ray's default power-of-two router and Ray's text-matching ``PrefixCacheAffinityRouter``.

``--overhead`` adds a workload with no shared prefix (every request its own prompt),
through ``vllm-router --policy round_robin`` and kvpage on Ray: what Ray's hop and the
routing cost where there is nothing to gain.

Each configuration starts from fresh replicas (empty caches). The workload
(:func:`shared_prefix_requests`): ``--prefixes`` system prompts of ``--prefix-tokens``
random tokens, each followed by ``--turns`` user turns of ``--turn-tokens`` tokens,
arriving interleaved (every prefix's turn 0 in a random order, then every turn 1, ...)
with ``--concurrency``
in flight, ``--output-len`` tokens each. Each replica's KV pool holds about
``--cache-fraction`` of all prefixes beside the requests it runs
(``--num-gpu-blocks``), as a replica whose cache is smaller than its traffic's working
set: round-robin makes every replica cache every prefix, so they evict each other's
work; routing by cached blocks partitions them.

Printed per configuration: mean / p50 / p99 time to first token, output and total
tokens per second, the prefix-cache hit rate (prompt tokens found in the replicas'
caches over all prompt tokens, from their ``/metrics``), and the ratios the issue
targets. Needs ``vllm-router`` (``pip install vllm-router``) on PATH or ``--vllm-router``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvpage.bench.common import BenchRequest, format_table

MODEL_NAME = "bench"
CONFIGS = ("single replica", "router round_robin", "router cache_aware", "router kv_aware",
           "ray kvpage", "ray pow2", "ray prefix")
OVERHEAD_CONFIGS = ("unique: router round_robin", "unique: ray kvpage")
BLOCK = 16


def shared_prefix_requests(prefixes: int, prefix_tokens: int, turns: int, turn_tokens: int,
                           output_len: int, vocab: int, seed: int) -> list[BenchRequest]:
    """The interleaved shared-prefix workload (module docs), in arrival order."""
    rng = random.Random(seed)
    heads = [[rng.randrange(100, vocab) for _ in range(prefix_tokens)] for _ in range(prefixes)]
    out = []
    for _ in range(turns):
        # Each round visits every prefix in a fresh order: a fixed cycle of an even number
        # of prefixes would send each prefix to the same one of two round-robin replicas.
        for head in rng.sample(heads, len(heads)):
            tail = [rng.randrange(100, vocab) for _ in range(turn_tokens)]
            out.append(BenchRequest(head + tail, output_len))
    return out


class Replica:
    """One ``kvpage serve`` process on one CPU, publishing its KV events."""

    def __init__(self, model: str, cpu: int | None, blocks: int, context: int, workdir: Path,
                 index: int) -> None:
        from kvpage.bench.first_minute import kvpage_serve_command
        from kvpage.bench.loopback import free_port

        self.port, self.events_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.events = f"tcp://127.0.0.1:{self.events_port}"
        events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{self.events_port}"}
        command = kvpage_serve_command(
            model, self.port, "--served-model-name", MODEL_NAME, "--num-gpu-blocks",
            str(blocks), "--max-model-len", str(context), "--block-size", str(BLOCK),
            "--warmup", "full", "--kv-events-config", json.dumps(events))
        if cpu is not None and shutil.which("taskset"):
            command = ["taskset", "-c", str(cpu), *command]
        self.log = open(workdir / f"replica{index}.log", "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self) -> None:
        from kvpage.bench.first_minute import wait_health

        wait_health(self.url, self.proc, time.perf_counter())

    def cache_tokens(self) -> tuple[float, float]:
        """(prompt tokens looked up, found) in this replica's prefix cache so far."""
        import httpx

        text = httpx.get(self.url + "/metrics", timeout=30).text

        def total(name: str) -> float:
            found = re.findall(rf"^kvpage:{name}\{{[^}}]*\}} ([0-9.e+]+)$", text, re.M)
            return sum(float(v) for v in found)

        return total("prefix_cache_queries_total"), total("prefix_cache_hits_total")

    def stop(self) -> None:
        from kvpage.bench.first_minute import stop

        stop(self.proc)
        self.log.close()


def router_command(binary: str, port: int, policy: str, replicas: list[Replica],
                   log_level: str = "warning") -> list[str]:
    command = [binary, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
               "--worker-urls", *[r.url for r in replicas], "--log-level", log_level,
               "--request-timeout-secs", "600"]
    if policy == "kv_aware":
        for replica in replicas:
            command += ["--kv-event-source", f"{replica.url}={replica.events}"]
        command += ["--kv-event-model", MODEL_NAME, "--kv-event-block-size", str(BLOCK)]
    return command


def wait_router(url: str, proc: subprocess.Popen[Any]) -> None:
    import httpx

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vllm-router exited with {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError("vllm-router did not become healthy in 60 s")


class RayApp:
    """``kvpage serve MODEL --replicas N --pin-cpus`` on a local Ray cluster: the
    replicas and the ingress, stopped together."""

    def __init__(self, args: argparse.Namespace, router: str, blocks: int, context: int,
                 workdir: Path) -> None:
        from kvpage.bench.first_minute import kvpage_serve_command
        from kvpage.bench.loopback import free_port

        self.url = f"http://127.0.0.1:{free_port()}"
        command = kvpage_serve_command(
            args.model, int(self.url.rsplit(":", 1)[1]), "--served-model-name", MODEL_NAME,
            "--num-gpu-blocks", str(blocks), "--max-model-len", str(context), "--block-size",
            str(BLOCK), "--warmup", "full", "--replicas", str(args.replicas), "--router",
            router, "--pin-cpus", "--public-metrics")
        self.log = open(workdir / f"ray-{router}.log", "ab")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)

    def wait_ready(self) -> None:
        import httpx

        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:  # /health answers once a replica is up
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvpage serve --replicas exited with {self.proc.returncode}")
            try:
                text = httpx.get(self.url + "/metrics", timeout=10).text
                if len(set(re.findall(r'replica="([^"]+)"', text))) >= 1 and \
                        httpx.get(self.url + "/health", timeout=10).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
        raise RuntimeError("kvpage on Ray did not become ready in 600 s")

    cache_tokens = Replica.cache_tokens  # /metrics sums every replica's series

    def stop(self) -> None:
        from kvpage.bench.first_minute import stop

        stop(self.proc)
        self.log.close()


def run_config(name: str, args: argparse.Namespace, requests: list[BenchRequest],
               blocks: int, context: int, workdir: Path) -> dict[str, Any]:
    from kvpage.bench.loopback import free_port

    kind, policy = name.split()[-2:]
    if kind == "ray":
        app = RayApp(args, policy, blocks, context, workdir)
        try:
            app.wait_ready()
            return _measure(name, args, requests, app.url, [app])
        finally:
            app.stop()
    count = 1 if name == "single replica" else args.replicas
    cpus = range(count) if count > 1 else [None]
    if count == 1:  # the reference: every CPU and every replica's KV pool in one
        blocks *= args.replicas
    replicas = [Replica(args.model, cpu, blocks, context, workdir, i)
                for i, cpu in zip(range(count), cpus, strict=True)]
    router = None
    try:
        for replica in replicas:  # one compile at a time
            replica.wait_ready()
        url = replicas[0].url
        if count > 1:
            port = free_port()
            log = open(workdir / f"router-{policy}.log", "ab")  # noqa: SIM115
            router = subprocess.Popen(router_command(args.vllm_router, port, policy, replicas,
                                                     args.router_log_level),
                                      stdout=log, stderr=subprocess.STDOUT,
                                      start_new_session=True)
            url = f"http://127.0.0.1:{port}"
            wait_router(url, router)
            time.sleep(1.0)  # the router's event subscriptions land
        return _measure(name, args, requests, url, replicas)
    finally:
        if router is not None:
            router.terminate()
            router.wait(30)
        for replica in replicas:
            replica.stop()


def _measure(name: str, args: argparse.Namespace, requests: list[BenchRequest], url: str,
             servers: list[Any]) -> dict[str, Any]:
    """The workload through ``url``; the hit rate from ``servers``' metrics."""
    from kvpage.bench.serve import run_requests_online, summarize

    records, duration = asyncio.run(run_requests_online(
        url, requests, model=MODEL_NAME, max_concurrency=args.concurrency, timeout_s=600.0))
    result = summarize(records, duration, args.concurrency, float("inf"))
    looked, found = (sum(v) for v in zip(*(s.cache_tokens() for s in servers), strict=True))
    ttfts = [r.ttft for r in records if r.ok]
    print(f"[bench scaleout] {name}: mean TTFT {result.ttft_ms['mean']:.0f} ms, "
          f"{result.total_token_throughput:.0f} tok/s, hit rate "
          f"{100 * found / looked if looked else 0:.1f} %", file=sys.stderr, flush=True)
    return {"config": name, "completed": result.completed, "failed": result.failed,
            "errors": result.errors[:3], "ttft_ms": result.ttft_ms,
            "mean_ttft_s": sum(ttfts) / len(ttfts) if ttfts else math.nan,
            "output_tok_s": result.output_throughput,
            "total_tok_s": result.total_token_throughput, "duration_s": duration,
            "hit_rate": found / looked if looked else 0.0}


def run(args: argparse.Namespace) -> dict[str, Any]:
    binary = args.vllm_router or shutil.which("vllm-router")
    if binary is None:
        raise SystemExit("kvpage bench scaleout needs vllm-router: pip install vllm-router "
                         "(or pass --vllm-router PATH)")
    args.vllm_router = binary
    requests = shared_prefix_requests(args.prefixes, args.prefix_tokens, args.turns,
                                      args.turn_tokens, args.output_len, args.vocab, args.seed)
    context = args.prefix_tokens + args.turn_tokens + args.output_len + BLOCK
    all_prefix_blocks = args.prefixes * math.ceil(args.prefix_tokens / BLOCK)
    # Room for the requests one replica runs at once (its share of the concurrency, and
    # one more): the rest of the pool is its prefix cache.
    in_flight = (math.ceil(args.concurrency / args.replicas) + 1) * math.ceil(context / BLOCK)
    blocks = args.num_gpu_blocks or (math.ceil(args.cache_fraction * all_prefix_blocks)
                                     + in_flight)
    workdir = Path(tempfile.mkdtemp(prefix="kvpage-bench-scaleout-"))
    print(f"[bench scaleout] {len(requests)} requests, {blocks} KV blocks per replica "
          f"(all prefixes: {all_prefix_blocks}); logs in {workdir}", file=sys.stderr)
    results = [run_config(name, args, requests, blocks, context, workdir)
               for name in (args.configs or CONFIGS)]
    if args.overhead:  # every request its own prompt: nothing to gain from routing
        unique = shared_prefix_requests(len(requests), args.prefix_tokens, 1,
                                        args.turn_tokens, args.output_len, args.vocab,
                                        args.seed + 1)
        results += [run_config(name, args, unique, blocks, context, workdir)
                    for name in OVERHEAD_CONFIGS]
    return {"model": args.model, "replicas": args.replicas, "blocks_per_replica": blocks,
            "requests": len(requests), "workload": {
                "prefixes": args.prefixes, "prefix_tokens": args.prefix_tokens,
                "turns": args.turns, "turn_tokens": args.turn_tokens,
                "output_len": args.output_len, "concurrency": args.concurrency},
            "configs": results}


def print_table(result: dict[str, Any]) -> None:
    by = {c["config"]: c for c in result["configs"]}
    rr = by.get("router round_robin", result["configs"][0])
    rows = []
    for c in result["configs"]:
        rows.append([
            c["config"], f"{c['completed']}/{c['completed'] + c['failed']}",
            f"{c['ttft_ms']['mean']:.0f}", f"{c['ttft_ms']['median']:.0f}",
            f"{c['ttft_ms']['p99']:.0f}", f"{c['output_tok_s']:.1f}",
            f"{c['total_tok_s']:.0f}", f"{100 * c['hit_rate']:.1f} %",
            f"{c['ttft_ms']['mean'] / rr['ttft_ms']['mean']:.2f}x",
            f"{c['total_tok_s'] / rr['total_tok_s']:.2f}x",
        ])
    w = result["workload"]
    print(f"{result['replicas']} replicas of {result['model']}, {result['blocks_per_replica']} "
          f"KV blocks each; {w['prefixes']} prefixes x {w['prefix_tokens']} tokens, "
          f"{w['turns']} turns of {w['turn_tokens']}, {w['output_len']} out, "
          f"{w['concurrency']} in flight")
    print(format_table(["config", "ok", "TTFT mean ms", "p50", "p99", "output tok/s",
                        "total tok/s", "prefix hit rate", "TTFT / round_robin",
                        "tok/s / round_robin"], rows))


TARGETS = (  # (what, numerator config, denominator config, figure, bound)
    ("kv_aware TTFT / round_robin (<= 0.67)", "router kv_aware", "router round_robin",
     "ttft", 0.67),
    ("Ray: kvpage tok/s / pow2 (>= 1.5)", "ray kvpage", "ray pow2", "tok_s", 1.5),
    ("Ray: kvpage TTFT / pow2 (<= 0.5)", "ray kvpage", "ray pow2", "ttft", 0.5),
    ("Ray: kvpage tok/s / PrefixCacheAffinityRouter (>= 1.2)", "ray kvpage", "ray prefix",
     "tok_s", 1.2),
    ("Ray: kvpage hit rate - single replica (>= -5 points)", "ray kvpage", "single replica",
     "hit", -5.0),
    ("no shared prefix: kvpage on Ray tok/s / round_robin (>= 0.9)", "unique: ray kvpage",
     "unique: router round_robin", "tok_s", 0.9),
)


def print_targets(result: dict[str, Any]) -> None:
    """The issue's targets that this run's configurations measure."""
    by = {c["config"]: c for c in result["configs"]}
    for what, num, den, figure, bound in TARGETS:
        if num not in by or den not in by:
            continue
        a, b = by[num], by[den]
        if figure == "hit":
            value = 100 * (a["hit_rate"] - b["hit_rate"])
            met = value >= bound
        elif figure == "ttft":
            value = a["ttft_ms"]["mean"] / b["ttft_ms"]["mean"]
            met = value <= bound
        else:
            value = a["total_tok_s"] / b["total_tok_s"]
            met = value >= bound
        print(f"  {what}: {value:.2f} ({'met' if met else 'MISSED'})")


def cmd_scaleout(args: argparse.Namespace) -> int:
    result = run(args)
    print_table(result)
    print_targets(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("scaleout", help="replicas behind vllm-router: kv_aware on kvpage's "
                       "KV events vs round_robin and cache_aware",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="a .gguf file or HF directory every replica serves")
    p.add_argument("--replicas", type=int, default=2, help="replicas behind the gateway")
    p.add_argument("--prefixes", type=int, default=8, help="shared system prompts")
    p.add_argument("--prefix-tokens", type=int, default=1000, help="tokens per system prompt")
    p.add_argument("--turns", type=int, default=16, help="user turns per system prompt")
    p.add_argument("--turn-tokens", type=int, default=32, help="tokens per user turn")
    p.add_argument("--output-len", type=int, default=16, help="tokens generated per request")
    p.add_argument("--concurrency", type=int, default=4, help="requests in flight")
    p.add_argument("--vocab", type=int, default=32000,
                   help="token ids are drawn below this (at most the model's vocabulary)")
    p.add_argument("--cache-fraction", type=float, default=0.5,
                   help="share of all prefixes one replica's KV pool holds")
    p.add_argument("--num-gpu-blocks", type=int, default=None,
                   help="KV blocks per replica (default: from --cache-fraction)")
    p.add_argument("--vllm-router", default=None, help="vllm-router binary (default: PATH)")
    p.add_argument("--router-log-level", default="warning",
                   choices=("debug", "info", "warning", "error"),
                   help="vllm-router's log level (its logs: the run's temporary directory)")
    p.add_argument("--configs", nargs="+", default=None, choices=CONFIGS,
                   help="run only these configurations (default: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload's tokens")
    p.add_argument("--overhead", action="store_true",
                   help="also run a workload with no shared prefix through round_robin and "
                   "kvpage on Ray (the cost of Ray's hop and of routing)")
    p.add_argument("--json", default=None, help="write the figures to this file")
    p.set_defaults(func=cmd_scaleout)
