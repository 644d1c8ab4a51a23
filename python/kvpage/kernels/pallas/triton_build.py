"""Build the Pallas kernels for an H100 (sm_90a) on a machine without a GPU.

Owns the "does the GPU path build" proof that CI runs on CPU:

* :func:`capture_triton_modules` traces a function with ``lowering_platforms=
  ("cuda",)`` and records the Triton IR (TTIR) of every ``pallas_call`` the
  Pallas Triton lowering emits, with its ``num_warps`` / ``num_stages``.
* :func:`compile_sm90a` compiles one TTIR module with the ``triton`` package
  (torch's Triton 3.x) for ``sm_90a`` through to ``ptxas`` (which Triton ships
  under ``triton/backends/nvidia/bin``) and reads ``ptxas -v``: registers,
  spill stores/loads, the dynamic shared memory Triton asks for, which MMA
  instructions the PTX uses; occupancy (blocks per SM) is derived from the H100
  limits below. Results are cached on disk by a hash of (TTIR, options, Triton
  version), so repeated CI runs only pay for lowering.
* :func:`kernel_report` builds both kernels at the Llama-3-8B attention shape
  (32 q / 8 KV heads, head_dim 128, block 16) and at a GQA-odd real shape
  (SmolLM2: 9 q / 3 KV heads, head_dim 64) in bf16 and f32.

Run ``python -m kvpage.kernels.pallas.triton_build`` for the table. Nothing here runs a
kernel; a GPU is never needed.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import hashlib
import io
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp

# H100 SXM per-SM limits (also H200: same SM).
SM_REGISTERS = 65536
SM_SHARED_BYTES = 228 * 1024
BLOCK_RESERVED_SHARED = 1024  # the driver reserves 1 KiB of shared memory per block
SM_MAX_WARPS = 64
SM_MAX_BLOCKS = 32
REG_ALLOC_UNIT = 256  # registers are allocated per warp in units of 256

# name, q heads, KV heads, head_dim (block size 16 everywhere).
SHAPES = {
    "llama3-8b": (32, 8, 128),
    "gqa-odd": (9, 3, 64),
}
BLOCK_SIZE = 16


@dataclasses.dataclass(frozen=True)
class TritonModule:
    """One ``pallas_call`` as the Triton lowering emitted it."""

    name: str
    ttir: str
    num_warps: int
    num_stages: int
    grid: tuple[int, ...]


@dataclasses.dataclass(frozen=True)
class KernelBuild:
    """What ``ptxas`` made of one kernel for sm_90a."""

    name: str
    registers: int
    spill_stores: int
    spill_loads: int
    stack_bytes: int
    shared_bytes: int
    num_warps: int
    blocks_per_sm: int
    mma: str  # "wgmma", "mma.sync" or "none"
    compile_s: float


def triton_available() -> str | None:
    """None when Triton and its ptxas can compile here; otherwise the reason why not."""
    try:
        import triton  # noqa: F401
        from triton.backends.nvidia import compiler
    except Exception as exc:  # pragma: no cover - depends on the environment
        return f"the triton package (with its NVIDIA backend) is not importable: {exc}"
    try:
        path = compiler.get_ptxas(90).path
    except Exception as exc:  # pragma: no cover
        return f"triton finds no ptxas: {exc}"
    if not path or not os.access(path, os.X_OK):  # pragma: no cover
        return f"triton's ptxas ({path}) is not executable"
    return None


@contextlib.contextmanager
def capture_triton_modules() -> Iterator[list[TritonModule]]:
    """Record every Triton module the Pallas lowering builds inside the block."""
    from jax._src.pallas.triton import pallas_call_registration as registration

    lowering = registration.lowering
    original = lowering.lower_jaxpr_to_triton_module
    captured: list[TritonModule] = []

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        caller = sys._getframe(1).f_locals  # pallas_call_lowering's launch params
        module = result.module.operation
        captured.append(
            TritonModule(
                name=str(module.attributes["sym_name"]).strip('"'),
                ttir=module.get_asm(enable_debug_info=False),
                num_warps=int(caller.get("num_warps", 4)),
                num_stages=int(caller.get("num_stages", 3)),
                grid=tuple(result.grid),
            )
        )
        return result

    lowering.lower_jaxpr_to_triton_module = wrapper
    try:
        yield captured
    finally:
        lowering.lower_jaxpr_to_triton_module = original


def lower_for_cuda(fn: Callable[..., Any], *args: Any) -> list[TritonModule]:
    """Lower ``jax.jit(fn)(*args)`` for CUDA and return its Triton modules."""
    with capture_triton_modules() as captured:
        jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))
    return captured


def _cache_dir() -> Path:
    root = os.environ.get("KVPAGE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "kvpage"
    )
    return Path(root) / "sm90a-builds"


def _parse_ptxas_log(log: str) -> dict[str, int]:
    def grab(pattern: str) -> int:
        match = re.search(pattern, log)
        return int(match.group(1)) if match else 0

    if "Used" not in log:
        raise RuntimeError(f"unexpected ptxas log:\n{log}")
    return {
        "registers": grab(r"Used (\d+) registers"),
        "spill_stores": grab(r"(\d+) bytes spill stores"),
        "spill_loads": grab(r"(\d+) bytes spill loads"),
        "stack_bytes": grab(r"(\d+) bytes stack frame"),
    }


def blocks_per_sm(registers: int, shared_bytes: int, num_warps: int) -> int:
    """Resident blocks per H100 SM given registers/thread, shared bytes/block and warps."""
    regs_per_warp = -(-registers * 32 // REG_ALLOC_UNIT) * REG_ALLOC_UNIT
    by_regs = SM_REGISTERS // max(1, regs_per_warp * num_warps)
    by_smem = SM_SHARED_BYTES // (shared_bytes + BLOCK_RESERVED_SHARED)
    by_warps = SM_MAX_WARPS // num_warps
    return max(0, min(by_regs, by_smem, by_warps, SM_MAX_BLOCKS))


def compile_sm90a(module: TritonModule, *, use_cache: bool = True) -> KernelBuild:
    """Compile one TTIR module for sm_90a with Triton + ptxas (no GPU needed)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    options = {"num_warps": module.num_warps, "num_stages": module.num_stages}
    key = hashlib.sha256(
        json.dumps([module.ttir, options, triton.__version__, "sm_90a"]).encode()
    ).hexdigest()[:32]
    cache = _cache_dir() / f"{key}.json"
    if use_cache and cache.exists():
        return KernelBuild(**json.loads(cache.read_text()))

    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # silence 3.9's warning
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / f"{module.name}.ttir"
        src.write_text(module.ttir)
        log = io.StringIO()
        with (
            knobs.nvidia.scope(),
            knobs.cache.scope(),
            contextlib.redirect_stdout(log),
        ):
            knobs.nvidia.dump_ptxas_log = True
            knobs.cache.dir = str(Path(tmp) / "triton-cache")  # always run ptxas
            compiled = triton.compile(str(src), target=GPUTarget("cuda", 90, 32), options=options)
    elapsed = time.perf_counter() - start
    stats = _parse_ptxas_log(log.getvalue())
    ptx = compiled.asm["ptx"]
    mma = "wgmma" if "wgmma." in ptx else "mma.sync" if "mma.sync" in ptx else "none"
    shared = int(compiled.metadata.shared)
    build = KernelBuild(
        name=module.name,
        shared_bytes=shared,
        num_warps=module.num_warps,
        blocks_per_sm=blocks_per_sm(stats["registers"], shared, module.num_warps),
        mma=mma,
        compile_s=round(elapsed, 2),
        **stats,
    )
    if use_cache:
        with contextlib.suppress(OSError):
            cache.parent.mkdir(parents=True, exist_ok=True)
            cache.write_text(json.dumps(dataclasses.asdict(build)))
    return build


def kernel_args(
    shape: str,
    dtype: Any,
    *,
    rows: int = 8,
    tokens: int | None = None,
    max_blocks: int = 32,
    pages: int = 512,
) -> tuple[jax.ShapeDtypeStruct, ...]:
    """Abstract paged-attention operands (contract of ``reference.py``) at a named shape."""
    hq, hkv, d = SHAPES[shape]
    sds = jax.ShapeDtypeStruct
    tokens = rows if tokens is None else tokens
    return (
        sds((tokens, hq, d), dtype),
        sds((hkv, pages, BLOCK_SIZE, d), dtype),
        sds((hkv, pages, BLOCK_SIZE, d), dtype),
        sds((rows,), jnp.int32),
        sds((rows, max_blocks), jnp.int32),
        sds((rows + 1,), jnp.int32),
        sds((1,), jnp.int32),
    )


def kernel_modules(kernel: str, shape: str, dtype: Any) -> list[TritonModule]:
    """Triton modules of one kernel (``"decode"``, ``"ragged"`` or ``"mixed"``)."""
    from kvpage.kernels.pallas.paged_decode_attention import paged_decode_attention
    from kvpage.kernels.pallas.ragged_paged_attention import ragged_paged_attention

    d = SHAPES[shape][2]
    if kernel == "decode":
        fn = functools.partial(paged_decode_attention, sm_scale=d**-0.5)
        args = kernel_args(shape, dtype)
    elif kernel == "ragged":
        fn = functools.partial(ragged_paged_attention, sm_scale=d**-0.5)
        args = kernel_args(shape, dtype, rows=8, tokens=256)
    else:
        raise ValueError(f"unknown kernel {kernel!r}")
    return lower_for_cuda(fn, *args)


def kernel_report(
    kernels: tuple[str, ...] = ("decode", "ragged"),
    shapes: tuple[str, ...] = tuple(SHAPES),
    dtypes: tuple[str, ...] = ("bfloat16", "float32"),
    *,
    use_cache: bool = True,
) -> list[dict[str, Any]]:
    """Compile every (kernel, shape, dtype) for sm_90a; one row per Triton kernel."""
    rows = []
    for shape in shapes:
        for kernel in kernels:
            for dtype in dtypes:
                for module in kernel_modules(kernel, shape, jnp.dtype(dtype)):
                    build = compile_sm90a(module, use_cache=use_cache)
                    rows.append(
                        {"kernel": kernel, "shape": shape, "dtype": dtype}
                        | dataclasses.asdict(build)
                    )
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    head = (
        f"{'kernel':<7} {'shape':<10} {'dtype':<9} {'regs':>5} {'spill st/ld B':>13} "
        f"{'smem KiB':>8} {'warps':>5} {'blk/SM':>6} {'mma':<8} {'compile s':>9}  triton kernel"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['kernel']:<7} {r['shape']:<10} {r['dtype']:<9} {r['registers']:>5} "
            f"{str(r['spill_stores']) + '/' + str(r['spill_loads']):>13} "
            f"{r['shared_bytes'] / 1024:>8.1f} {r['num_warps']:>5} {r['blocks_per_sm']:>6} "
            f"{r['mma']:<8} {r['compile_s']:>9.2f}  {r['name']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvpage.kernels.pallas.triton_build",
        description="Compile the Pallas kernels for sm_90a (H100) without a GPU.",
    )
    parser.add_argument("--kernels", nargs="+", default=["decode", "ragged"])
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--no-cache", action="store_true", help="always run triton + ptxas")
    parser.add_argument("--json", action="store_true", help="print JSON rows instead")
    args = parser.parse_args(argv)
    reason = triton_available()
    if reason:
        print(f"cannot compile for sm_90a here: {reason}", file=sys.stderr)
        return 2
    rows = kernel_report(
        tuple(args.kernels), tuple(args.shapes), tuple(args.dtypes), use_cache=not args.no_cache
    )
    if args.json:
        print(json.dumps(rows, indent=1))
    else:
        print("sm_90a builds (Triton + ptxas on this CPU machine; occupancy from H100 limits)")
        print(format_table(rows))
    bad = [r for r in rows if r["dtype"] == "bfloat16" and (r["spill_stores"] or r["spill_loads"])]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
