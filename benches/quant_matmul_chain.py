"""Quantized linear layers against float32 ones, per row count, through JAX.

Each layer of SmolLM2-135M's matmuls (q, k, v, o, gate, up, down: ``[T, 576]`` and
``[T, 1536]`` inputs) 30 times over, jitted with the runner's kernel switch on
(``kvpage.model.linear_kernels.host_matmuls``), once with float32 weights (XLA's dot
or the host small-batch kernel) and once with Q4_1 blocks (``rust/kernels/quant``: the
one-row integer path, the float-expansion path, or dequantize + XLA's GEMM from
``kvpage.kernels.host.cpu_qmatmul.DEQUANTIZE_ROWS``). The 7 weights are reused by every
layer, so they stay in cache: this measures compute, not weight streaming. Mean of 5
runs after one warm-up.

    python benches/quant_matmul_chain.py [--rows 1,4,8,16,64,256] [--kind q4_1]
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

SHAPES = [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576),
          (576, 1536)]
GGUF_TYPES = {"q8_0": "Q8_0", "q4_0": "Q4_0", "q4_1": "Q4_1"}


def main() -> None:
    import gguf
    from gguf.quants import quantize
    from kvpage.model.linear_kernels import host_matmuls, matmul_nt
    from kvpage.quant.weights import QuantizedWeight

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", default="1,4,8,16,64,256")
    parser.add_argument("--kind", default="q4_1", choices=sorted(GGUF_TYPES))
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    floats = [rng.standard_normal(s).astype(np.float32) * 0.02 for s in SHAPES]
    qtype = gguf.GGMLQuantizationType[GGUF_TYPES[args.kind]]
    quantized = [QuantizedWeight(jnp.asarray(quantize(w, qtype)), args.kind, w.shape)
                 for w in floats]

    def layers(weights: list, x: jax.Array) -> jax.Array:
        for _ in range(30):
            for w in weights:
                inp = x if w.shape[1] == 576 else jnp.tile(x, (1, 3))
                y = matmul_nt(inp, w)
                x = x + jnp.tile(y, (1, 3))[:, :576] * 1e-3
        return x

    print(f"{'rows':>5} {'float32 ms':>11} {args.kind + ' ms':>9}")
    for rows in (int(r) for r in args.rows.split(",")):
        x = jnp.ones((rows, 576), jnp.float32)
        times = []
        for weights in ([jnp.asarray(w) for w in floats], quantized):
            with host_matmuls(True):
                step = jax.jit(layers).lower(weights, x).compile()
            step(weights, x).block_until_ready()
            start = time.perf_counter()
            for _ in range(5):
                step(weights, x).block_until_ready()
            times.append((time.perf_counter() - start) / 5 * 1e3)
        print(f"{rows:>5} {times[0]:>11.1f} {times[1]:>9.1f}")


if __name__ == "__main__":
    main()
