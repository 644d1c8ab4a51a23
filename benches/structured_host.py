"""Host cost of structured outputs in the engine: half the requests follow a JSON
schema, half are free text; reports the Rust mask computation per constrained
sequence per step, how often it finished while the device was still running the
step's forward pass (hidden), and the engine's device / host-gap split against the
same workload without constraints.

    python3 benches/structured_host.py [MODEL] [--requests 32] [--max-tokens 64]

MODEL defaults to the tiny model shipped with kvpage (any HF directory or .gguf works).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from kvpage import LLM, SamplingParams
from kvpage.structured_outputs import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 130},
        "tags": {"type": "array", "items": {"enum": ["admin", "dev", "ops"]}, "maxItems": 4},
        "address": {"type": "object",
                    "properties": {"street": {"type": "string", "maxLength": 30},
                                   "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["street", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "tags", "address"],
    "additionalProperties": False,
}


def run(llm: LLM, requests: int, max_tokens: int, constrained: bool) -> dict[str, Any]:
    engine = llm.engine
    params = []
    for i in range(requests):
        guided = constrained and i % 2 == 0
        params.append(SamplingParams(
            temperature=1.0, seed=i, max_tokens=max_tokens, ignore_eos=not guided,
            structured_outputs=StructuredOutputsParams(json=SCHEMA) if guided else None,
        ))
    before = dict(engine.counters)
    timing_before = engine.timing.as_dict()
    start = time.perf_counter()
    outs = llm.generate([f"Person {i} as JSON:" for i in range(requests)], params,
                        use_tqdm=False)
    wall = time.perf_counter() - start
    c = engine.counters
    rows = c["structured_mask_rows"] - before["structured_mask_rows"]
    steps = c["structured_mask_steps"] - before["structured_mask_steps"]
    hidden = c["structured_mask_hidden_steps"] - before["structured_mask_hidden_steps"]
    mask_s = c["structured_mask_s"] - before["structured_mask_s"]
    timing = engine.timing.as_dict()
    n_steps = timing["steps"] - timing_before["steps"]
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return {
        "wall_s": wall, "tokens": tokens, "steps": n_steps,
        "mask_us_per_constrained_seq_step": 1e6 * mask_s / rows if rows else 0.0,
        "mask_ms_per_step": 1e3 * mask_s / steps if steps else 0.0,
        "constrained_rows": rows, "hidden_fraction": hidden / steps if steps else 0.0,
        "finish": sorted({o.outputs[0].finish_reason for o in outs}),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--max-model-len", type=int, default=256)
    args = parser.parse_args()
    if args.model is None:
        from kvpage.assets import default_model_dir

        args.model = str(default_model_dir())
    llm = LLM(args.model, max_num_seqs=args.requests, max_model_len=args.max_model_len,
              max_num_batched_tokens=max(512, args.requests))
    run(llm, args.requests, 8, True)  # compile the step buckets and the grammar
    run(llm, args.requests, 8, False)
    for constrained in (False, True):
        t0 = llm.engine.timing.as_dict()
        result = run(llm, args.requests, args.max_tokens, constrained)
        t1 = llm.engine.timing.as_dict()
        steps = t1["steps"] - t0["steps"]
        dev = (t1["mean_device_ms"] * t1["steps"] - t0["mean_device_ms"] * t0["steps"]) / steps
        gap = (t1["mean_host_gap_ms"] * t1["steps"]
               - t0["mean_host_gap_ms"] * t0["steps"]) / steps
        label = "50% constrained" if constrained else "unconstrained"
        print(f"{label:>16}: {result['tokens'] / result['wall_s']:.0f} tok/s, "
              f"device {dev:.2f} ms/step, host gap {gap:.2f} ms/step, "
              f"mask {result['mask_us_per_constrained_seq_step']:.1f} us per constrained "
              f"seq-step ({result['mask_ms_per_step']:.2f} ms/step, "
              f"{result['constrained_rows']} rows), hidden behind the forward in "
              f"{100 * result['hidden_fraction']:.0f}% of steps; finish {result['finish']}")


if __name__ == "__main__":
    main()
