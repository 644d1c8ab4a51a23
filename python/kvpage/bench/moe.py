"""``kvpage bench moe``: mixture-of-experts decode, routed against dense compute and llama.cpp.

In one run, on one random Qwen3-MoE GGUF file written for the run
(:mod:`kvpage.bench.moe_model`: 32 experts, top-4, Q4_0 blocks by default), each server
in its own process on this machine, all up at once and taking turns at each level:

* ``kvpage serve`` with its defaults: the experts run only where tokens are routed
  (the Rust expert kernel streams each routed expert's blocks once per step);
* ``kvpage serve --cpu-input-bits 8``: the same, its inputs to the quantized products
  rounded to 8 bits per block as llama.cpp rounds them (its ``q8`` inputs; kvpage's
  default keeps 16), the packed 4-bit kernels' multiply-adds halved
  (``--input-bits 16`` leaves it out);
* ``kvpage serve`` computing every expert for every token
  (``KVPAGE_MOE_DENSE_COMPUTE=1``): the same model's dense-compute equivalent;
* llama.cpp's ``llama-server`` on the same file (``--llama-server PATH``, else on PATH;
  skipped with a message when absent).

At each ``--concurrency`` level the same fixed-length requests go through the same
streaming client (a warm-up round, then the timed round), ``ignore_eos``. Printed:
generated tokens per second, the ratios kvpage / llama.cpp (each input precision) and
routed / dense, and the bytes per decode token: the active experts' bytes (``top_k``
experts per layer) against the expert bytes the routed kernel streams (each distinct
routed expert once per step, so at batch 1 exactly the active experts; at batch ``B``
the expected number of distinct experts under uniform routing, shared by the ``B``
tokens).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvpage.bench.common import format_table, synthetic_requests
from kvpage.bench.moe_model import MoEShape, write_random_moe_gguf

ROUTED = "kvpage (routed)"
ROUTED_8_BIT = "kvpage (routed, 8-bit inputs)"
DENSE = "kvpage (dense compute)"


def expert_traffic(shape: MoEShape, batch: int) -> dict[str, float]:
    """Expert bytes per decoded token: active (``top_k`` per layer) and streamed by the
    routed kernel at ``batch`` tokens a step (distinct experts, expected under uniform
    routing, each read once per step and shared by the step's tokens)."""
    per_expert = shape.expert_bytes()
    active = shape.layers * shape.top_k * per_expert
    untouched = (1 - shape.top_k / shape.experts) ** batch
    distinct = shape.experts * (1 - untouched) if batch > 1 else shape.top_k
    streamed = shape.layers * distinct * per_expert / batch
    dense = shape.layers * shape.experts * per_expert / batch
    return {"active_mb": active / 1e6, "streamed_mb": streamed / 1e6,
            "dense_mb": dense / 1e6, "streamed_over_active": streamed / active}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvpage.bench.first_minute import kvpage_serve_command
    from kvpage.bench.loopback import free_port
    from kvpage.bench.vs_llama_cpp import Server, llama_command, run_servers
    from kvpage.engine.loading import MOE_DENSE_COMPUTE_ENV

    shape = MoEShape(kind=args.kind)
    workdir = Path(tempfile.mkdtemp(prefix="kvpage-bench-moe-"))
    model = str(write_random_moe_gguf(workdir / "moe.gguf", shape, seed=args.seed))
    levels = sorted(set(args.concurrency))
    requests = {
        # Eight requests at least: two (the first version) timed 0.25 s at one request.
        level: synthetic_requests(max(8, 2 * level), input_len=args.input_len,
                                  output_len=args.output_len, vocab_size=shape.vocab,
                                  seed=args.seed + level)
        for level in levels
    }
    top = max(levels)
    context = args.input_len + args.output_len + 16
    servers: list[Server] = []
    try:
        kvpage_servers = [(ROUTED, "routed", 16, {})]
        if 8 in args.input_bits:
            kvpage_servers.append((ROUTED_8_BIT, "routed-8-bit", 8, {}))
        kvpage_servers.append((DENSE, "dense", 16, {MOE_DENSE_COMPUTE_ENV: "1"}))
        for name, log, bits, env in kvpage_servers:
            port = free_port()
            command = kvpage_serve_command(model, port, "--max-num-seqs", str(top),
                                           "--warmup", "full", "--cpu-input-bits", str(bits))
            servers.append(Server(name, command, f"http://127.0.0.1:{port}",
                                  workdir / f"{log}.log", env=env))
            servers[-1].wait_ready()  # one compile at a time
        binary = args.llama_server or shutil.which("llama-server")
        if binary is None:
            print("[bench moe] llama-server not found (pass --llama-server PATH): skipping "
                  "llama.cpp", file=sys.stderr)
        else:
            port = free_port()
            servers.append(Server("llama.cpp", llama_command(binary, model, port, top, context),
                                  f"http://127.0.0.1:{port}", workdir / "llama-server.log"))
        run_servers(servers, requests)
    finally:
        for server in servers:
            server.stop()
    return {
        "model": {"shape": shape.__dict__, "file_mb": Path(model).stat().st_size / 1e6},
        "concurrency": levels,
        "servers": [server.result for server in servers],
        "traffic": {level: expert_traffic(shape, level) for level in levels},
    }


def print_table(result: dict[str, Any]) -> None:
    by_name = {s["server"]: s for s in result["servers"]}
    rows = []
    for level in result["concurrency"]:
        r, r8, d, ll = (by_name[name]["levels"][level]["output_tok_s"]
                        if name in by_name else None
                        for name in (ROUTED, ROUTED_8_BIT, DENSE, "llama.cpp"))
        t = result["traffic"][level]
        rows.append([
            level,
            f"{r:.1f}" if r else "-", f"{r8:.1f}" if r8 else "-", f"{d:.1f}" if d else "-",
            f"{ll:.1f}" if ll else "-",
            f"{r / ll:.2f}x" if r and ll else "-", f"{r8 / ll:.2f}x" if r8 and ll else "-",
            f"{r / d:.2f}x" if r and d else "-",
            f"{t['active_mb']:.1f}", f"{t['streamed_mb']:.1f} ({t['streamed_over_active']:.2f}x)",
        ])
    shape = result["model"]["shape"]
    print(f"random Qwen3-MoE: {shape['experts']} experts, top-{shape['top_k']}, "
          f"{shape['layers']} layers, hidden {shape['hidden']}, expert width "
          f"{shape['expert_width']}, {shape['kind']} ({result['model']['file_mb']:.0f} MB)")
    print(format_table(
        ["concurrency", "kvpage tok/s", "8-bit inputs tok/s", "dense-compute tok/s",
         "llama.cpp tok/s", "kvpage / llama.cpp", "8-bit / llama.cpp", "routed / dense",
         "active expert MB/token",
         "expert MB streamed/token"],
        rows,
    ))


def cmd_moe(args: argparse.Namespace) -> int:
    result = run(args)
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("moe", help="MoE decode: routed vs dense compute vs llama-server",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-server", default=None, help="llama-server binary (default: PATH)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 32],
                   help="requests in flight")
    p.add_argument("--kind", default="Q4_0", choices=["Q4_0", "Q8_0"],
                   help="block format of the random weights")
    p.add_argument("--input-bits", type=int, nargs="+", default=[16, 8], choices=[16, 8],
                   help="input precisions of the routed kvpage servers (--cpu-input-bits): "
                   "16 (the default server) always, 8 (llama.cpp's) unless left out")
    p.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=64, help="generated tokens per request")
    p.add_argument("--seed", type=int, default=0, help="weights and workload seed")
    p.add_argument("--json", default=None, help="write the figures to this file")
    p.set_defaults(func=cmd_moe)

