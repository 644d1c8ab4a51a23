"""One call for the first session that gets a GPU: check, then time, everything.

    python benches/gpu_check.py [--quick] [--skip-e2e]

1. Correctness on the GPU: the compiled Pallas kernels (decode, ragged, mixed)
   against ``python/kvpage/kernels/xla/reference.py`` at Llama-3-8B and GQA-odd shapes,
   bf16 and f32; with a sliding window, logit soft-cap and attention sinks, blocks
   outside the window poisoned with NaN; the grouped (MoE) matmul against
   ``jax.lax.ragged_dot``.
2. sm_90a build report (``kvpage.kernels.pallas.triton_build``), for comparison with
   the CPU-side prediction in benches/RESULTS.md.
3. Timing: measured copy bandwidth (the practical HBM roofline), the decode
   kernel's achieved KV bandwidth at several (batch, context) points, and
   ``jax.experimental.pallas.ops.gpu.paged_attention`` on the same inputs.
   The grouped matmul's weight bandwidth next to ``jax.lax.ragged_dot``.
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


def check_options(quick: bool) -> bool:
    """The compiled kernels with a sliding window, soft-cap and sinks against the
    reference, every block wholly outside a row's window filled with NaN."""
    from kvpage.kernels import dispatch
    from kvpage.kernels.xla.reference import ragged_paged_attention_reference as ref

    rng = np.random.default_rng(4)
    ok = True
    steps = {
        "decode": ([1] * 16, [int(x) for x in rng.integers(1, 3000, 16)]),
        "mixed": ([1] * 6 + [37, 200], [int(x) for x in rng.integers(1, 3000, 6)] + [90, 700]),
    }
    cases = {"window": dict(sliding_window=100), "all": dict(sliding_window=37, cap=30.0)}
    for name, opts in cases.items() if not quick else list(cases.items())[1:]:
        for shape, (hq, hkv, d) in {"llama3-8b": (32, 8, 128), "gqa-odd": (9, 3, 64)}.items():
            for step, (q_lens, kv_lens) in steps.items():
                args = list(make_inputs(rng, q_lens, kv_lens, hq, hkv, d, 16, jnp.bfloat16))
                window = opts["sliding_window"]
                tables, k, v = np.asarray(args[4]), np.asarray(args[1]), np.asarray(args[2])
                k, v = k.astype(np.float32), v.astype(np.float32)
                for row, (ql, kl) in enumerate(zip(q_lens, kv_lens, strict=True)):
                    for b in range(max(0, kl - ql - window + 1) // 16):
                        k[:, tables[row, b]] = np.nan
                        v[:, tables[row, b]] = np.nan
                args[1], args[2] = jnp.asarray(k, jnp.bfloat16), jnp.asarray(v, jnp.bfloat16)
                kw = dict(sm_scale=d**-0.5, sliding_window=window, logit_soft_cap=opts.get("cap"))
                if name == "all":
                    kw["sinks"] = jnp.asarray(rng.standard_normal(hq), jnp.float32)
                want = np.asarray(ref(*args, **kw), np.float32)
                got = dispatch.paged_attention(
                    *args, **kw, backend="pallas", decode_only=step == "decode"
                )
                got = np.asarray(got, np.float32)
                err = float(np.max(np.abs(got - want)))
                good = err <= 2e-2 and bool(np.isfinite(got).all())
                ok &= good
                print(
                    f"  {name:<7} {shape:<10} {step:<8} max|err| {err:.2e} (tol 2e-02) "
                    f"{'ok' if good else 'FAIL'}"
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


# ---- grouped matmul (MoE experts) ------------------------------------------------------

# name -> (experts, K, N) of an expert up projection, HF [out, in] weight [E, N, K].
GROUPED_SHAPES = {"qwen3-30b-a3b-up": (128, 2048, 768), "mixtral-8x7b-up": (8, 4096, 14336)}


def _grouped_inputs(rng, rows, e, k, n, dtype, *, top_k=8):
    """Rows from a random top-k routing (a few experts left empty), 5 padding rows."""
    tokens = max(1, (rows - 5) // min(top_k, e))
    picks = rng.integers(0, max(1, e - 2), (tokens, min(top_k, e)))  # last 2 experts empty
    sizes = np.bincount(picks.ravel(), minlength=e).astype(np.int32)
    x = jnp.asarray(rng.standard_normal((rows, k)) * 0.1, dtype)
    w = jnp.asarray(rng.standard_normal((e, n, k)) * 0.1, dtype)
    return x, w, jnp.asarray(sizes), int(sizes.sum()), int((sizes > 0).sum())


def check_grouped_matmul(quick: bool) -> bool:
    """The compiled grouped-matmul kernel against ``jax.lax.ragged_dot`` on the device."""
    from kvpage.kernels.pallas.grouped_matmul import grouped_matmul

    rng = np.random.default_rng(2)
    ok = True
    for shape, (e, k, n) in GROUPED_SHAPES.items():
        for dtype in (jnp.bfloat16,) if quick else (jnp.bfloat16, jnp.float32):
            for rows in (64, 2048):
                x, w, g, total, _ = _grouped_inputs(rng, rows, e, k, n, dtype)
                want = jax.lax.ragged_dot(x, w.transpose(0, 2, 1), g,
                                          precision=jax.lax.Precision.HIGHEST,
                                          preferred_element_type=jnp.float32)  # fmt: skip
                got = grouped_matmul(x, w, g, preferred_element_type=jnp.float32)
                err = float(jnp.max(jnp.abs(got - want)))
                pad_zero = not bool(jnp.any(got[total:]))
                tol = 2e-2 if dtype == jnp.bfloat16 else 2e-3
                good = err <= tol and pad_zero
                ok &= good
                print(
                    f"  grouped {shape:<17} {jnp.dtype(dtype).name:<9} rows {rows:>5} "
                    f"max|err| {err:.2e} (tol {tol:.0e}) padding zero {pad_zero} "
                    f"{'ok' if good else 'FAIL'}"
                )
    return ok


def time_grouped_matmul(copy_bw: float) -> None:
    """Grouped matmul vs ``jax.lax.ragged_dot`` (XLA); bandwidth counts active experts."""
    from kvpage.kernels.pallas.grouped_matmul import grouped_matmul

    rng = np.random.default_rng(3)
    print(f"  {'grouped shape':<17} {'rows':>5} {'kvpage us':>10} {'GB/s':>7} {'% copy':>7} "
          f"{'ragged_dot us':>13}")  # fmt: skip
    ours = jax.jit(grouped_matmul)
    theirs = jax.jit(lambda x, w, g: jax.lax.ragged_dot(x, w.transpose(0, 2, 1), g))
    for shape, (e, k, n) in GROUPED_SHAPES.items():
        for rows in (64, 512, 4096):
            x, w, g, _, active = _grouped_inputs(rng, rows, e, k, n, jnp.bfloat16)
            nbytes = active * n * k * 2 + rows * (k + n) * 2
            t_ours = _time(ours, x, w, g)
            try:
                theirs_s = f"{_time(theirs, x, w, g) * 1e6:>13.1f}"
            except Exception as exc:  # noqa: BLE001 - report and go on
                theirs_s = f"failed: {type(exc).__name__}"
            print(
                f"  {shape:<17} {rows:>5} {t_ours * 1e6:>10.1f} {nbytes / t_ours / 1e9:>7.0f} "
                f"{nbytes / t_ours / copy_bw:>7.0%} {theirs_s}"
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
    ok &= check_options(args.quick)
    ok &= check_grouped_matmul(args.quick)
    print("2. sm_90a build report")
    from kvpage.kernels.pallas import triton_build

    print(triton_build.format_table(triton_build.kernel_report(use_cache=False)))
    print("3. timings")
    bw = copy_bandwidth()
    print(f"  measured copy bandwidth: {bw / 1e9:.0f} GB/s")
    time_decode(bw)
    time_grouped_matmul(bw)
    print("4. end to end")
    subprocess.run([sys.executable, "-m", "kvpage.cli", "bench", "roofline"], check=False)
    if not args.skip_e2e:
        subprocess.run([sys.executable, "-m", "kvpage.cli", "bench", "vs-hf"], check=False)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
