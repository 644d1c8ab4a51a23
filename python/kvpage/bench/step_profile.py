"""``kvpage bench step-profile``: where one decode step's time goes.

Two measurements on the same model and shapes (``--rows`` sequences decoding with
``--context`` tokens of KV each):

1. The engine (every setting at its default, one step per device call): ``rows``
   requests are prefilled, then ``--steps`` decode steps are timed; the engine's own
   clock splits each step into device time (dispatch to sampled tokens) and the host
   gap (scheduling, input packing, detokenization and output assembly while the device
   idles). Where multi-step decode applies (``num_scheduler_steps``, small batches on
   CPU), the same decode is timed again with several steps per call, per token.
2. Component executables at the step's padded shapes, each compiled on its own and timed
   by the median of ``--repeats`` runs: the decoder layers without attention (the
   matmuls, norms, RoPE, residuals), the K/V write, the paged attention (the decoder
   with the backend's attention minus without), the final norm + vocabulary projection
   at the sampled rows, and the sampler (gathering the per-request sampling state,
   greedy or top-p sampling, recording the tokens).

Components are measured apart, so their sum differs a little from the fused step
(XLA fuses across component boundaries inside the step).
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvpage.bench.common import format_table, write_json


def _median_ms(fn: Callable[[], Any], repeats: int) -> float:
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def engine_decode_step(llm: Any, rows: int, context: int, steps: int) -> dict[str, float]:
    """Prefill ``rows`` requests of ``context`` tokens, then time ``steps`` decode steps
    (per token: with multi-step decode one ``engine.step()`` runs several)."""
    from kvpage.engine.llm_engine import StepTiming
    from kvpage.sampling.params import SamplingParams

    engine = llm.engine
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=steps + 32, temperature=0.0, ignore_eos=True)
    ids = []
    vocab = llm.engine.runner.config.vocab_size
    for i in range(rows):  # ids well inside the vocabulary, past the special tokens
        prompt = rng.integers(min(1000, vocab // 4), min(30000, vocab), size=context).tolist()
        engine.add_request(f"profile-{i}", {"prompt_token_ids": prompt}, params)
        ids.append(f"profile-{i}")
    def pure_decode() -> bool:
        stats = engine.scheduler.stats()
        return (
            stats["num_requests_waiting"] == 0
            and stats["last_step_tokens"] == stats["last_step_seqs"] == rows
        )

    engine.step()
    while not pure_decode():  # prefill every request
        engine.step()
    for _ in range(2):  # the decode bucket is compiled and the pipeline full
        engine.step()
    engine.timing = StepTiming()
    generated = engine.counters["generation_tokens"]
    start = time.perf_counter()
    while engine.counters["generation_tokens"] - generated < steps * rows:
        engine.step()
    wall = time.perf_counter() - start
    steps = (engine.counters["generation_tokens"] - generated) // rows
    timing = engine.timing.as_dict()
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return {
        "wall_ms_per_step": 1e3 * wall / steps,
        "device_ms_per_step": timing["mean_device_ms"],
        "host_gap_ms_per_step": timing["mean_host_gap_ms"],
    }


def component_times(llm: Any, rows: int, context: int, repeats: int) -> dict[str, float]:
    """Median ms of each component executable at the runner's padded decode shapes,
    traced with the runner's kernel choices (the host matmul where the step uses it)."""
    from kvpage.model.linear_kernels import host_matmuls

    with host_matmuls(llm.engine.runner.mesh is None):
        return _component_times(llm, rows, context, repeats)


def _component_times(llm: Any, rows: int, context: int, repeats: int) -> dict[str, float]:
    from kvpage.model.attention import AttentionBackend
    from kvpage.model.decoder import AttentionMetadata, compute_logits, decoder_hidden_states
    from kvpage.runner.kv_cache import KVCacheSpec, allocate_kv_cache
    from kvpage.sampling.sampler import sample
    from kvpage.sampling.table import gather_inputs, record_sampled

    runner = llm.engine.runner
    config, params, backend = runner.config, runner.params, runner.backend
    t_pad, s_pad = runner.executables.padded_sizes(rows, rows)
    block = runner.block_size
    per_row = math.ceil(context / block)
    spec = KVCacheSpec.for_model(
        config, block, s_pad * per_row + 1, runner.kv_spec.dtype, runner.tensor_parallel_size
    )
    pools = allocate_kv_cache(spec)
    tables = np.full((s_pad, runner.max_blocks_per_seq), spec.scratch_block, np.int32)
    for r in range(rows):
        tables[r, :per_row] = np.arange(r * per_row, (r + 1) * per_row)
    kv_lens = np.zeros(s_pad, np.int32)
    kv_lens[:rows] = context
    slots = np.full(t_pad, spec.scratch_slot, np.int32)
    slots[:rows] = tables[:rows, (context - 1) // block] * block + (context - 1) % block
    cu = np.minimum(np.arange(s_pad + 1), rows).astype(np.int32)
    meta = AttentionMetadata(
        slot_mapping=jnp.asarray(slots),
        block_tables=jnp.asarray(tables),
        kv_lens=jnp.asarray(kv_lens),
        cu_q_lens=jnp.asarray(cu),
        num_seqs=jnp.asarray([rows], jnp.int32),
    )
    tokens = jnp.asarray(np.arange(t_pad) % 1000 + 1000, jnp.int32)
    positions = jnp.asarray(np.full(t_pad, context - 1), jnp.int32)

    def no_attend(q: jax.Array, *args: Any, **kwargs: Any) -> jax.Array:
        return q

    def no_write(k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array,
                 *args: Any) -> tuple[Any, Any]:
        # Keep the k and v projections alive (unused, XLA would drop them and bill them
        # to the KV write): one element of the pool takes 0 * their sums.
        touched = (jnp.sum(k) + jnp.sum(v)).astype(k_pages.dtype) * 0
        return k_pages.at[(0,) * k_pages.ndim].add(touched), v_pages

    variants = {
        "full": backend,
        "write_only": AttentionBackend("write", no_attend, backend.write_kv, False),
        "dense": AttentionBackend("none", no_attend, no_write, False),
    }
    layer_ms = {}
    state = {"pools": pools}
    for name, variant in variants.items():
        # The pools are donated and threaded through, as in the step: a scatter into
        # non-donated pools would copy them and bill the copy to attention.
        fn = jax.jit(
            lambda p, pl, v=variant: decoder_hidden_states(
                p, config, tokens, positions, pl, meta, v
            ),
            donate_argnums=1,
        )

        def call(f: Callable[..., Any] = fn) -> jax.Array:
            hidden, state["pools"] = f(params, state["pools"])
            return hidden

        layer_ms[name] = _median_ms(call, repeats)
    hidden = jnp.ones((s_pad, config.hidden_size), params["embed_tokens"]["weight"].dtype)
    lm_head = jax.jit(lambda p, h: compute_logits(p, config, h))
    logits = lm_head(params, hidden)
    sample_rows = jnp.arange(s_pad, dtype=jnp.int32) % runner.max_num_seqs
    valid = jnp.arange(s_pad) < rows

    table = runner.sampling_table

    def sampler(tbl: Any, lg: jax.Array, top_p: float) -> Any:
        inputs = gather_inputs(tbl, sample_rows)
        if top_p < 1.0:
            inputs = inputs._replace(
                temperature=jnp.full_like(inputs.temperature, 0.8),
                top_p=jnp.full_like(inputs.top_p, top_p),
            )
        else:
            inputs = inputs._replace(temperature=jnp.zeros_like(inputs.temperature))
        out = sample(lg, inputs, jax.random.key(0), runner.max_logprobs, False)
        return out.token_ids, record_sampled(tbl, sample_rows, out.token_ids, valid)

    # The table is donated, as in the step (record_sampled updates it in place).
    state = {"table": jax.tree_util.tree_map(jnp.copy, table)}
    greedy = jax.jit(lambda t, lg: sampler(t, lg, 1.0), donate_argnums=0)
    nucleus = jax.jit(lambda t, lg: sampler(t, lg, 0.95), donate_argnums=0)

    def run(fn: Callable[..., Any]) -> jax.Array:
        tokens, state["table"] = fn(state["table"], logits)
        return tokens

    return {
        "dense layers (matmuls, norms, rope)": layer_ms["dense"],
        "KV write": max(layer_ms["write_only"] - layer_ms["dense"], 0.0),
        "paged attention": max(layer_ms["full"] - layer_ms["write_only"], 0.0),
        "lm_head (final norm + vocab projection)": _median_ms(
            lambda: lm_head(params, hidden), repeats
        ),
        "sampling, greedy": _median_ms(lambda: run(greedy), repeats),
        "sampling, top-p 0.95 (not in this step)": _median_ms(lambda: run(nucleus), repeats),
    }


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "step-profile",
        help="where a decode step's time goes: engine host/device split and components",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", nargs="?", default=None,
                   help="a .gguf file or HF directory (default: SmolLM2-135M GGUF from PyPI)")
    p.add_argument("--rows", type=int, default=64, help="sequences decoding together")
    p.add_argument("--context", type=int, default=256, help="KV tokens per sequence")
    p.add_argument("--steps", type=int, default=10, help="engine decode steps to time")
    p.add_argument("--repeats", type=int, default=7, help="runs per component")
    p.add_argument("--quantization", default="auto",
                   help="weights as stored (auto) or 'none' (float32, as an RL trainer's)")
    p.add_argument("--json", default=None, help="write the figures to this JSON file")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from kvpage import LLM
    from kvpage.model.real_models import model_or_smollm2
    from kvpage.runner.multi_step import default_scheduler_steps

    model = model_or_smollm2(args.model)
    llm = LLM(model, quantization=args.quantization, num_scheduler_steps=1)
    engine = engine_decode_step(llm, args.rows, args.context, args.steps)
    multi = None
    llm.engine.runner.num_scheduler_steps = steps_per_call = default_scheduler_steps(
        llm.engine.runner.device.platform, llm.engine.runner.mesh, llm.engine.runner.params
    )
    if llm.engine.runner.multi_step.compile(args.rows):
        multi = engine_decode_step(llm, args.rows, args.context, args.steps)
    llm.engine.runner.num_scheduler_steps = 1
    parts = component_times(llm, args.rows, args.context, args.repeats)
    in_step = {k: v for k, v in parts.items() if "not in this step" not in k}
    total = sum(in_step.values()) + engine["host_gap_ms_per_step"]
    rows = [[k, f"{v:.1f}", f"{100 * v / total:.0f} %" if k in in_step else "-"]
            for k, v in parts.items()]
    rows.append(["host gap (engine clock)", f"{engine['host_gap_ms_per_step']:.1f}",
                 f"{100 * engine['host_gap_ms_per_step'] / total:.0f} %"])
    print(format_table(
        ["component", "ms", "share"], rows,
        title=f"decode step, {args.rows} rows x {args.context} KV tokens; engine: "
              f"{engine['wall_ms_per_step']:.1f} ms/step wall, "
              f"{engine['device_ms_per_step']:.1f} ms device",
    ))
    if multi is not None:
        print(f"multi-step decode ({steps_per_call} steps per call): "
              f"{multi['wall_ms_per_step']:.1f} ms a token wall, against "
              f"{engine['wall_ms_per_step']:.1f} ms one step per call")
    if args.json:
        write_json(args.json, {"model": model, "rows": args.rows, "context": args.context,
                               "engine": engine, "engine_multi_step": multi,
                               "components_ms": parts})
    return 0
