"""Compile time of a step bucket against the model's depth (issue #25's depth target).

    python benches/compile_depth.py [--layers 30,60]

Builds a model with SmolLM2-135M's shapes (random weights) at each depth and times the
compile of a decode bucket and a prefill bucket, with no persistent cache, in this
process. The step compiles one layer and calls it per layer, so the figures should not
move with depth; the old all-layers trace grew linearly (4.5-4.8 s per bucket at 30).
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import Any

import numpy as np


def smollm2_shapes() -> Any:
    from kvpage.model.config import ModelConfig

    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5, tie_word_embeddings=True, dtype="float32",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--layers", default="30,60", help="depths to compare")
    args = parser.parse_args()

    from kvpage.model.params import param_spec, tree_from_flat
    from kvpage.runner.model_runner import ModelRunner

    base = smollm2_shapes()
    print(f"{'layers':>6} {'bucket':>16} {'compile s':>10} {'executables':>12}")
    for layers in (int(x) for x in args.layers.split(",")):
        config = dataclasses.replace(base, num_layers=layers)
        params = tree_from_flat(
            config, {n: np.zeros(s, np.float32) for n, s in param_spec(config).items()}
        )
        runner = ModelRunner(config, params, num_blocks=256, block_size=16, max_model_len=2048,
                             max_num_seqs=256, max_num_batched_tokens=2048)
        for key in ((1, 1, True), (64, 4, False)):
            before = runner.executables.num_compilations
            start = time.perf_counter()
            runner.executables.bucket(key)
            seconds = time.perf_counter() - start
            print(f"{layers:>6} {str(key):>16} {seconds:>10.2f} "
                  f"{runner.executables.num_compilations - before:>12}")


if __name__ == "__main__":
    main()
