"""What prompt scoring (``SamplingParams.prompt_logprobs``) costs, offline.

Prefills ``--num-prompts`` random prompts of ``--input-len`` tokens with ``max_tokens=1``,
plain and with ``prompt_logprobs=1`` (prefix cache off, so both compute every
position), after one compiling run of each; prints the median of ``--repeats`` runs.

    python benches/prompt_logprobs_cost.py [MODEL]   # default: the SmolLM2 GGUF
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from kvpage import LLM, SamplingParams
from kvpage.model.real_models import model_or_smollm2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", help="HF model directory or .gguf file")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(model_or_smollm2(args.model), max_num_seqs=args.num_prompts,
              max_num_batched_tokens=256, max_model_len=max(512, args.input_len + 1),
              enable_prefix_caching=False)
    vocab = llm.engine.model_config.vocab_size
    rng = np.random.default_rng(0)
    prompts = [{"prompt_token_ids": rng.integers(10, vocab, args.input_len).tolist()}
               for _ in range(args.num_prompts)]
    runs = {"plain": SamplingParams(temperature=0, max_tokens=1),
            "prompt_logprobs=1": SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)}
    for params in runs.values():  # compile
        llm.generate(prompts, params, use_tqdm=False)
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(args.repeats):
        for name, params in runs.items():
            start = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            times[name].append(time.perf_counter() - start)
    for name, values in times.items():
        print(f"{name}: median {1e3 * float(np.median(values)):.0f} ms for "
              f"{args.num_prompts} x {args.input_len} prompt tokens")


if __name__ == "__main__":
    main()
