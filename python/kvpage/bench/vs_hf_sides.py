"""The two contestants of ``kvpage bench vs-hf``, each run in its own process.

This file owns what one side does with a scenario (a JSON spec written by
:mod:`kvpage.bench.vs_hf`): load the model, run the requests twice (the first pass
with other prompt tokens of the same lengths, so the second pass finds nothing in a
prefix cache and no compile left to do), and write timings and the generated tokens
to a JSON file.

* ``kvpage``: ``LLM(model)`` with every engine setting at its default; all requests
  of a scenario are handed to one ``generate`` call (continuous batching decides),
  except ``one_at_a_time`` scenarios (batch 1), which call ``generate`` per request.
* ``hf``: ``transformers`` ``AutoModelForCausalLM`` in float32 and ``generate`` over
  static batches of ``hf_batch_size`` requests in arrival order, left-padded to the
  batch's longest prompt, each batch running to its longest output (EOS suppressed),
  as naive serving does. Only each request's own output length counts as useful.

Run as ``python -m kvpage.bench.vs_hf_sides SIDE SPEC.json OUT.json``.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def prompts_for_pass(spec: dict[str, Any], pass_index: int) -> list[list[int]]:
    """Prompt token ids of one pass: the scenario's lengths, tokens seeded by the pass."""
    rng = np.random.default_rng([int(spec["seed"]), pass_index])
    low, high = spec["token_range"]
    return [rng.integers(low, high, size=n).tolist() for n in spec["prompt_lens"]]


def _useful_tokens(spec: dict[str, Any]) -> int:
    return int(sum(spec["output_lens"]))


def run_kvpage(spec: dict[str, Any]) -> dict[str, Any]:
    import tempfile

    import jax

    from kvpage import LLM, SamplingParams

    # An empty persistent compilation cache: the cold pass compiles everything, as the
    # first run on a new machine does (the engine leaves a configured cache alone).
    cache_dir = tempfile.mkdtemp(prefix="kvpage-vs-hf-xla-")
    jax.config.update("jax_compilation_cache_dir", cache_dir)
    t0 = time.perf_counter()
    llm = LLM(spec["model"], **spec.get("engine_args", {}))  # default: nothing tuned
    load_s = time.perf_counter() - t0
    params = [
        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        for n in spec["output_lens"]
    ]
    passes, outputs = [], []
    for pass_index in range(2):
        prompts = [{"prompt_token_ids": p} for p in prompts_for_pass(spec, pass_index)]
        start = time.perf_counter()
        if spec["one_at_a_time"]:
            results = [
                llm.generate(p, sp, use_tqdm=False)[0]
                for p, sp in zip(prompts, params, strict=True)
            ]
        else:
            results = llm.generate(prompts, params, use_tqdm=False)
        passes.append(time.perf_counter() - start)
        outputs = [list(r.outputs[0].token_ids) for r in results]
    runner = llm.engine.runner
    shutil.rmtree(cache_dir, ignore_errors=True)
    return {
        "load_s": load_s,
        "cold_pass_s": passes[0],
        "warm_pass_s": passes[1],
        "useful_tokens": _useful_tokens(spec),
        "compiled_executables": runner.executables.num_compilations,
        "step_buckets": [list(k) for k in runner.executables.compiled_buckets],
        "kv_cache": runner.kv_cache_decision.describe(),
        "max_model_len": runner.max_model_len,
        "host_kernels": host_kernels(),
        "outputs": outputs,
    }


def host_kernels() -> str:
    """Which of kvpage's host CPU kernels this process routes to (a figure is only
    comparable with figures taken with the same ones)."""
    from kvpage.kernels.host import cpu_decode_attention, cpu_matmul

    used = [
        name
        for name, on in (
            ("decode attention", cpu_decode_attention.available()),
            ("small-batch matmul", cpu_matmul.available()),
        )
        if on
    ]
    return ", ".join(used) or "none"


def run_hf(spec: dict[str, Any]) -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model_path = Path(spec["model"])
    t0 = time.perf_counter()
    if model_path.suffix == ".gguf":
        model = AutoModelForCausalLM.from_pretrained(
            str(model_path.parent), gguf_file=model_path.name, dtype=torch.float32
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(str(model_path), dtype=torch.float32)
    model.eval()
    load_s = time.perf_counter() - t0
    pad_id = int(model.config.pad_token_id or model.config.eos_token_id or 0)
    batch_size = 1 if spec["one_at_a_time"] else int(spec["hf_batch_size"])
    out_lens = list(spec["output_lens"])

    def run_pass(prompts: list[list[int]]) -> list[list[int]]:
        outputs: list[list[int]] = []
        for start in range(0, len(prompts), batch_size):
            batch = prompts[start : start + batch_size]
            wants = out_lens[start : start + batch_size]
            width = max(len(p) for p in batch)
            ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
            mask = torch.zeros((len(batch), width), dtype=torch.long)
            for i, p in enumerate(batch):  # left padding, as generate expects
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            new = max(wants)
            with torch.inference_mode():
                generated = model.generate(
                    input_ids=ids,
                    attention_mask=mask,
                    max_new_tokens=new,
                    min_new_tokens=new,  # no early EOS: ignore_eos, like the kvpage side
                    do_sample=False,
                    pad_token_id=pad_id,
                )
            for i, want in enumerate(wants):
                outputs.append(generated[i, width : width + want].tolist())
        return outputs

    passes, outputs = [], []
    for pass_index in range(2):
        start = time.perf_counter()
        outputs = run_pass(prompts_for_pass(spec, pass_index))
        passes.append(time.perf_counter() - start)
    return {
        "load_s": load_s,
        "cold_pass_s": passes[0],
        "warm_pass_s": passes[1],
        "useful_tokens": _useful_tokens(spec),
        "batch_size": batch_size,
        "torch_threads": torch.get_num_threads(),
        "outputs": outputs,
    }


SIDES = {"kvpage": run_kvpage, "hf": run_hf}


def main(argv: list[str] | None = None) -> int:
    side, spec_path, out_path = argv or sys.argv[1:]
    spec = json.loads(Path(spec_path).read_text())
    result = SIDES[side](spec)
    Path(out_path).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
