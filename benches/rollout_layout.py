"""What reading a trainer's kernel layout in place costs kvpage: the same rollout with
SmolLM2's weights as kvpage's own ``[out, in]`` matrices and as tunix's ``[in...,
out...]`` kernels (``TransposedWeight``: XLA's dot contracts the kernel's first axis,
and the host small-batch matmul kernel, which reads ``[out, in]`` rows, is not used).

GRPO-like: ``--prompts`` prompts x ``--samples`` samples x ``--max-tokens`` tokens at
temperature 1, prefix cache reset between runs, every bucket compiled first
(``warmup="full"``); best of ``--repeats`` runs per layout, layouts interleaved.
Needs no tunix (the tunix layout is built by :func:`tunix_arrays_from_params`).

    python benches/rollout_layout.py [--prompts 16 --samples 8 --max-tokens 128]
"""

from __future__ import annotations

import argparse
import time

from kvpage import LLM, SamplingParams
from kvpage.bench.rollout import PROMPTS
from kvpage.engine.llm_engine import load_model_and_tokenizer
from kvpage.integrations.tunix_layout import params_from_tunix, tunix_arrays_from_params
from kvpage.model.real_models import find_or_fetch_smollm2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    config, params, tokenizer, _ = load_model_and_tokenizer(
        find_or_fetch_smollm2(), dtype="float32", quantization="none"
    )
    layouts = {
        "hf [out, in]": params,
        "tunix kernels": params_from_tunix(tunix_arrays_from_params(config, params), config),
    }
    rows = args.prompts * args.samples
    blocks = rows * (-(-(64 + args.max_tokens) // 16) + 1) + 64
    engines = {
        name: LLM.from_params(config, p, tokenizer=tokenizer, max_num_seqs=rows,
                              num_gpu_blocks=blocks, max_model_len=64 + args.max_tokens + 1,
                              warmup="full")
        for name, p in layouts.items()
    }
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.prompts)]
    params_ = SamplingParams(n=args.samples, max_tokens=args.max_tokens, temperature=1.0,
                             seed=0, logprobs_mode="processed_logprobs")
    best = {name: 0.0 for name in engines}
    for _ in range(args.repeats):
        for name, llm in engines.items():
            llm.reset_prefix_cache()
            start = time.perf_counter()
            batch = llm.rollout(prompts, params_)
            rate = int(batch.lengths.sum()) / (time.perf_counter() - start)
            best[name] = max(best[name], rate)
    for name, rate in best.items():
        print(f"{name:14s} {rate:7.1f} tok/s  ({rate / best['hf [out, in]']:.2f}x)")


if __name__ == "__main__":
    main()
