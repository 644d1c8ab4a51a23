"""``kvpage bench roofline``: predicted per-step time on H100 / H200, from a simulated trace.

Nothing here runs on a GPU: every figure it prints is a *prediction* of a
roofline model, labelled as such. The trace comes from the real Rust
scheduler (the same loop as :mod:`kvpage.bench.sim`): for each step, each row's
new tokens (``q_len``) and KV length after the step. Per step the model counts

* bytes: all weights once (bf16) + the KV each row's attention reads + the
  KV written this step. Continuous+paged reads each row's *live* KV (the
  kernels stop at ``kv_len``); static+contiguous reads the padded rectangle
  (every seated row, finished ones included, up to the batch's longest row);
* FLOPs: ``2 x params`` per token through the layers, attention ``4 x D x Hq``
  per visible (query, key) pair, the LM head for sampled rows only;
* kernel launches per layer, each with a fixed cost;

and predicts ``max(bytes / (HBM x eff_bw), flops / (peak x eff_mma)) +
launches x launch_cost`` per step. The efficiency factors are assumptions,
printed with the result; change them with flags.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any

import numpy as np

GPUS = {  # HBM bytes/s, dense bf16 FLOP/s, HBM bytes
    "H100": (3.35e12, 989e12, 80e9),
    "H200": (4.8e12, 989e12, 141e9),
}


@dataclasses.dataclass(frozen=True)
class Assumptions:
    """Efficiency factors the prediction depends on (none of them measured)."""

    eff_bw: float = 0.80  # fraction of peak HBM bandwidth the step's kernels reach
    eff_mma: float = 0.60  # fraction of dense bf16 peak the GEMMs/attention reach
    launch_us: float = 2.0  # fixed cost per kernel (launch gap, tail), not overlapped
    kernels_per_layer: int = 9  # norm, qkv, rope+kv write, attention, o, norm, gate_up, act, down
    extra_mixed_kernels: int = 2  # mixed steps: ragged + split-K decode + combine
    host_us: float = 0.0  # host time per step not hidden behind the GPU


@dataclasses.dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    params: int  # all parameters
    dtype_bytes: int = 2

    @property
    def kv_bytes_per_token(self) -> int:  # K and V, all layers
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def from_preset(cls, name: str) -> ModelShape:
        from kvpage.model.params import param_spec
        from kvpage.model.presets import preset

        c = preset(name)
        params = sum(int(np.prod(s)) for s in param_spec(c).values())
        return cls(
            c.num_layers,
            c.hidden_size,
            c.num_heads,
            c.num_kv_heads,
            c.head_dim,
            c.vocab_size,
            params,
        )


@dataclasses.dataclass
class Step:
    q_lens: np.ndarray
    kv_lens: np.ndarray
    seated: int  # rows the step computes (static: finished rows still seated)
    sampled: int


def trace(policy: str, workload: list[Any], **sched_kwargs: Any) -> list[Step]:
    """Per-step rows of ``workload`` run through the real scheduler (random tokens)."""
    from kvpage._core import Scheduler

    sched = Scheduler(scheduling_policy=policy, eos_token_ids=[2], **sched_kwargs)
    rng = np.random.default_rng(0)
    pending = sorted(workload, key=lambda r: r.arrival)
    steps: list[Step] = []
    nxt, t, rows_before = 0, 0, 0
    while nxt < len(pending) or sched.has_unfinished_requests():
        while nxt < len(pending) and pending[nxt].arrival <= t:
            r = pending[nxt]
            sched.add_request(r.prompt_token_ids, max_tokens=r.output_len, ignore_eos=True)
            nxt += 1
        plan = sched.schedule()
        cu = np.asarray(plan.cu_q_lens)
        sched.update(rng.integers(3, 32000, size=plan.num_sampled, dtype=np.int64))
        rows = sched.stats()["seq_rows"]
        seated = max(rows - rows_before, int(plan.num_seqs))
        rows_before = rows
        n = int(plan.num_seqs)
        steps.append(
            Step(np.diff(cu)[:n], np.asarray(plan.kv_lens)[:n], seated, int(plan.num_sampled))
        )
        t += 1
    return steps


def step_cost(step: Step, m: ModelShape, contiguous: bool) -> tuple[float, float, int]:
    """(bytes, FLOPs, tokens) of one step."""
    q, kv = step.q_lens.astype(np.float64), step.kv_lens.astype(np.float64)
    tokens = float(q.sum())
    if contiguous:  # padded rectangle: every seated row up to the longest row
        read_tokens = step.seated * float(kv.max(initial=0))
    else:
        read_tokens = float(kv.sum())
    embed = m.vocab * m.hidden
    body = m.params - 2 * embed  # untied: embedding + LM head
    weight_bytes = (m.params - embed) * m.dtype_bytes  # the embedding is gathered, not read
    kv_bytes = (read_tokens + tokens) * m.kv_bytes_per_token
    # Visible (query, key) pairs: each query sees the prefix up to its position.
    pairs = float(np.sum(q * (kv - q) + q * (q + 1) / 2))
    if contiguous:
        pairs = max(pairs, float(step.seated * kv.max(initial=0)))  # padded rows compute too
        tokens_computed = max(tokens, float(step.seated))
    else:
        tokens_computed = tokens
    flops = 2.0 * body * tokens_computed + 2.0 * embed * step.sampled
    flops += 4.0 * m.head_dim * m.q_heads * pairs * m.layers
    return weight_bytes + kv_bytes, flops, int(tokens)


def predict(
    steps: list[Step], m: ModelShape, gpu: str, a: Assumptions, contiguous: bool
) -> dict[str, float]:
    bw, peak, _ = GPUS[gpu]
    total_s = mem_s = mma_s = launch_s = 0.0
    out_tokens = 0
    for st in steps:
        nbytes, flops, _ = step_cost(st, m, contiguous)
        t_mem = nbytes / (bw * a.eff_bw)
        t_mma = flops / (peak * a.eff_mma)
        mixed = bool((st.q_lens > 1).any()) and not contiguous
        launches = m.layers * (a.kernels_per_layer + (a.extra_mixed_kernels if mixed else 0)) + 3
        t_fixed = launches * a.launch_us * 1e-6 + a.host_us * 1e-6
        total_s += max(t_mem, t_mma) + t_fixed
        mem_s += t_mem
        mma_s += t_mma
        launch_s += t_fixed
        out_tokens += st.sampled
    return {
        "steps": len(steps),
        "output_tokens": out_tokens,
        "predicted_s": total_s,
        "predicted_tok_s": out_tokens / total_s if total_s else 0.0,
        "predicted_ms_per_step": 1e3 * total_s / max(1, len(steps)),
        "memory_bound_share": mem_s / max(1e-12, mem_s + mma_s),
        "launch_share": launch_s / max(1e-12, total_s),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    from kvpage.bench.workload import make_workload

    m = ModelShape.from_preset(args.model)
    a = Assumptions(eff_bw=args.eff_bw, eff_mma=args.eff_mma, launch_us=args.launch_us)
    workload = make_workload(
        args.num_requests,
        input_len=args.input_len,
        output_len=args.output_len,
        dist="sharegpt",
        seed=args.seed,
    )
    results: dict[str, Any] = {"model": args.model, "assumptions": dataclasses.asdict(a)}
    for gpu in args.gpus:
        bw, peak, hbm = GPUS[gpu]
        weight_bytes = m.params * m.dtype_bytes
        kv_tokens = int((hbm * 0.9 - weight_bytes) / m.kv_bytes_per_token)
        num_blocks = kv_tokens // args.block_size
        common = dict(
            num_blocks=num_blocks,
            block_size=args.block_size,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            enable_prefix_caching=False,
        )
        for label, policy, contiguous in (
            ("continuous+paged", "fcfs", False),
            ("static+contiguous", "static", True),
        ):
            steps = trace(
                policy, workload, max_num_batched_tokens=args.max_num_batched_tokens, **common
            )
            results[f"{gpu} {label}"] = predict(steps, m, gpu, a, contiguous) | {
                "kv_pool_tokens": kv_tokens
            }
    return results


def format_results(res: dict[str, Any]) -> str:
    a = res["assumptions"]
    lines = [
        f"roofline PREDICTION for {res['model']} (bf16), ShareGPT-like mix - nothing here was "
        "measured on a GPU",
        f"assumptions: {a['eff_bw']:.0%} of peak HBM bandwidth, {a['eff_mma']:.0%} of dense "
        f"bf16 peak, {a['launch_us']} us fixed per kernel, {a['kernels_per_layer']} kernels "
        f"per layer (+{a['extra_mixed_kernels']} in mixed paged steps), host time hidden",
        f"{'gpu / policy':<26} {'steps':>6} {'pred. ms/step':>13} {'pred. tok/s':>11} "
        f"{'pred. mem-bound':>15} {'pred. launch share':>18}",
    ]
    for key, r in res.items():
        if key in ("model", "assumptions"):
            continue
        lines.append(
            f"{key:<26} {r['steps']:>6} {r['predicted_ms_per_step']:>13.2f} "
            f"{r['predicted_tok_s']:>11.0f} {r['memory_bound_share']:>15.0%} "
            f"{r['launch_share']:>18.0%}"
        )
    for gpu in GPUS:
        c, s = res.get(f"{gpu} continuous+paged"), res.get(f"{gpu} static+contiguous")
        if c and s:
            lines.append(
                f"{gpu}: predicted continuous+paged / static+contiguous = "
                f"{c['predicted_tok_s'] / s['predicted_tok_s']:.2f}x"
            )
    return "\n".join(lines)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "roofline",
        help="predicted H100/H200 step time and tok/s from a simulated trace (no GPU)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default="llama-3-8b", help="preset (default llama-3-8b)")
    p.add_argument("--gpus", nargs="+", default=list(GPUS), choices=list(GPUS),
                   help="GPUs to predict for")
    p.add_argument("--num-requests", type=int, default=500, help="requests in the trace")
    p.add_argument("--input-len", type=int, default=230, help="mean prompt length")
    p.add_argument("--output-len", type=int, default=200, help="mean output length")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    p.add_argument("--max-num-seqs", type=int, default=256, help="seats")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="token budget per step")
    p.add_argument("--max-model-len", type=int, default=2048, help="longest sequence")
    p.add_argument("--eff-bw", type=float, default=Assumptions.eff_bw,
                   help="assumed share of peak HBM bandwidth reached")
    p.add_argument("--eff-mma", type=float, default=Assumptions.eff_mma,
                   help="assumed share of peak bf16 FLOPs reached")
    p.add_argument("--launch-us", type=float, default=Assumptions.launch_us,
                   help="assumed fixed cost per kernel launch, microseconds")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=cmd_roofline)


def cmd_roofline(args: argparse.Namespace) -> int:
    res = run(args)
    print(json.dumps(res, indent=1) if args.json else format_results(res))
    return 0
