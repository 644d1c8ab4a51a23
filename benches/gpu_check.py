"""One call for the first session that gets a GPU: check, then time, everything.

    python benches/gpu_check.py [--quick] [--skip-e2e]

1. Correctness on the GPU: the compiled Pallas kernels (decode, ragged, mixed)
   against ``python/kvpage/kernels/xla/reference.py`` at Llama-3-8B and GQA-odd shapes,
   bf16 and f32.
2. sm_90a build report (``kvpage.kernels.pallas.triton_build``), for comparison with
   the CPU-side prediction in benches/RESULTS.md.
3. Timing: measured copy bandwidth (the practical HBM roofline), the decode
   kernel's achieved KV bandwidth at several (batch, context) points, and
   ``jax.experimental.pallas.ops.gpu.paged_attention`` on the same inputs.
4. End to end: ``kvpage bench roofline`` (the prediction) next to
   ``kvpage bench vs-hf`` (measured, engine vs a naive HF loop).

Exits 2 without a GPU. Prints everything; nothing is written but stdout.
"""

from __future__ import annotations

import argparse
import functools
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


def _time(fn, *args, iters: int = 20) -> float:
    out = fn(*args)
    jax.block_until_ready(out)
    start = time.perf_counter()
    for _ in range(iters):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / iters


def make_inputs(rng, q_lens, kv_lens, hq, hkv, d, b, dtype):
    used = [-(-n // b) for n in kv_lens]
    max_blocks = max(used)
    pages = sum(used) + 1
    perm = rng.permutation(pages - 1)
    tables = np.zeros((len(kv_lens), max_blocks), np.int32)
    at = 0
    for i, n in enumerate(used):
        tables[i, :n] = perm[at : at + n]
        at += n
    t = sum(q_lens)
    q = jnp.asarray(rng.standard_normal((t, hq, d)), dtype)
    k = jnp.asarray(rng.standard_normal((hkv, pages, b, d)), dtype)
    v = jnp.asarray(rng.standard_normal((hkv, pages, b, d)), dtype)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    return (
        q,
        k,
        v,
        jnp.asarray(kv_lens, jnp.int32),
        jnp.asarray(tables),
        jnp.asarray(cu),
        jnp.asarray([len(q_lens)], jnp.int32),
    )


def check_correctness(quick: bool) -> bool:
    from kvpage.kernels import dispatch
    from kvpage.kernels.xla.reference import ragged_paged_attention_reference as ref

    rng = np.random.default_rng(0)
    ok = True
    shapes = {"llama3-8b": (32, 8, 128), "gqa-odd": (9, 3, 64)}
    steps = {
        "decode": ([1] * 16, [int(x) for x in rng.integers(1, 3000, 16)]),
        "mixed": ([1] * 6 + [37, 200], [int(x) for x in rng.integers(1, 3000, 6)] + [90, 700]),
        "prefill": ([512, 300], [512, 900]),
    }
    for shape, (hq, hkv, d) in shapes.items():
        for dtype in (jnp.bfloat16,) if quick else (jnp.bfloat16, jnp.float32):
            for step, (q_lens, kv_lens) in steps.items():
                args = make_inputs(rng, q_lens, kv_lens, hq, hkv, d, 16, dtype)
                want = np.asarray(ref(*args, sm_scale=d**-0.5), np.float32)
                got = dispatch.paged_attention(
                    *args, sm_scale=d**-0.5, backend="pallas", decode_only=step == "decode"
                )
                err = float(np.max(np.abs(np.asarray(got, np.float32) - want)))
                tol = 2e-2 if dtype == jnp.bfloat16 else 2e-3
                status = "ok" if err <= tol else "FAIL"
                ok &= err <= tol
                print(
                    f"  {shape:<10} {jnp.dtype(dtype).name:<9} {step:<8} max|err| {err:.2e} "
                    f"(tol {tol:.0e}) {status}"
                )
    return ok


def copy_bandwidth() -> float:
    x = jnp.ones((1 << 30,), jnp.bfloat16)  # 2 GiB
    f = jax.jit(lambda a: a + 1)
    return 2 * x.nbytes / _time(f, x)


def time_decode(copy_bw: float) -> None:
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_pa
    from kvpage.kernels.pallas.paged_decode_attention import paged_decode_attention

    rng = np.random.default_rng(1)
    hq, hkv, d, b = 32, 8, 128, 16
    print(
        f"  {'batch':>5} {'ctx':>6} {'kvpage us':>10} {'GB/s':>7} {'% copy':>7} "
        f"{'jax-ops us':>10} {'GB/s':>7}"
    )
    for batch, ctx in ((1, 2048), (8, 2048), (64, 1024), (64, 4096), (256, 1024)):
        args = make_inputs(rng, [1] * batch, [ctx] * batch, hq, hkv, d, b, jnp.bfloat16)
        kv_bytes = 2 * batch * ctx * hkv * d * 2
        ours = jax.jit(functools.partial(paged_decode_attention, sm_scale=d**-0.5))
        t_ours = _time(ours, *args)
        q, k, v, lens, tables = args[0], args[1], args[2], args[3], args[4]
        theirs = jax.jit(functools.partial(jax_pa.paged_attention, pages_per_compute_block=8))
        try:
            t_theirs = _time(theirs, q, k, v, tables, lens)
            theirs_s = f"{t_theirs * 1e6:>10.1f} {kv_bytes / t_theirs / 1e9:>7.0f}"
        except Exception as exc:  # noqa: BLE001 - report and go on
            theirs_s = f"failed: {type(exc).__name__}"
        print(
            f"  {batch:>5} {ctx:>6} {t_ours * 1e6:>10.1f} {kv_bytes / t_ours / 1e9:>7.0f} "
            f"{kv_bytes / t_ours / copy_bw:>7.0%} {theirs_s}"
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="bf16 only, fewer timings")
    parser.add_argument("--skip-e2e", action="store_true", help="no vs-hf end-to-end run")
    args = parser.parse_args()
    if jax.default_backend() not in ("gpu", "cuda"):
        print(f"no GPU here (jax backend {jax.default_backend()!r}); nothing to check")
        return 2
    print(f"device: {jax.devices()[0].device_kind}")
    print("1. kernels vs reference (compiled Pallas on this GPU)")
    ok = check_correctness(args.quick)
    print("2. sm_90a build report")
    from kvpage.kernels.pallas import triton_build

    print(triton_build.format_table(triton_build.kernel_report(use_cache=False)))
    print("3. timings")
    bw = copy_bandwidth()
    print(f"  measured copy bandwidth: {bw / 1e9:.0f} GB/s")
    time_decode(bw)
    print("4. end to end")
    subprocess.run([sys.executable, "-m", "kvpage.cli", "bench", "roofline"], check=False)
    if not args.skip_e2e:
        subprocess.run([sys.executable, "-m", "kvpage.cli", "bench", "vs-hf"], check=False)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
