"""XLA's dot against kvpage's host small-batch matmul, per row count.

A chain of 120 products of SmolLM2-135M's MLP shapes (30 layers of
``[T, 576] x [1536, 576]^T`` then ``[T, 1536] x [576, 1536]^T``, twice), jitted
once with XLA's dot and once through ``kvpage.kernels.host.cpu_matmul`` (which
routes to the Rust kernel only inside its row range; ``KVPAGE_CPU_MATMUL=1``
forces it for every T to measure outside that range). Median of 7 runs.

    python benches/cpu_matmul_chain.py [--rows 1,2,4,8,16,32]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from kvpage.kernels.host import cpu_matmul


def chain(use_kernel: bool):
    def product(x: jax.Array, w: jax.Array) -> jax.Array:
        if use_kernel:
            return cpu_matmul.cpu_matmul_nt(x, w, otherwise=lambda: x @ w.T)
        return x @ w.T

    def run(x: jax.Array, ups: list[jax.Array], downs: list[jax.Array]) -> jax.Array:
        for _ in range(2):
            for up, down in zip(ups, downs, strict=True):
                x = product(product(x, up), down) * 0.5
        return x

    return jax.jit(run)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,2,4,8,16,32")
    args = parser.parse_args()
    print(f"kernel lanes {cpu_matmul._lanes()}, routed up to {cpu_matmul.max_rows()} rows")
    rng = np.random.default_rng(0)
    ups = [jnp.asarray(rng.standard_normal((1536, 576), np.float32) / 24) for _ in range(30)]
    downs = [jnp.asarray(rng.standard_normal((576, 1536), np.float32) / 40) for _ in range(30)]
    for rows in (int(r) for r in args.rows.split(",")):
        x = jnp.asarray(rng.standard_normal((rows, 576), np.float32))
        times = {}
        for name, use_kernel in (("xla", False), ("kernel", True)):
            run = chain(use_kernel)
            run(x, ups, downs).block_until_ready()
            samples = []
            for _ in range(7):
                start = time.perf_counter()
                run(x, ups, downs).block_until_ready()
                samples.append(time.perf_counter() - start)
            times[name] = float(np.median(samples)) * 1e3
        print(f"T={rows:3d}: xla {times['xla']:6.1f} ms   kvpage route {times['kernel']:6.1f} ms")


if __name__ == "__main__":
    main()
