"""``kvpage bench rollout``: kvpage against tunix's own ``VanillaRollout`` as the rollout
engine of a GRPO step, on the same weights, in one run.

Both engines serve one tunix ``Llama3`` module holding the model's weights (SmolLM2-135M
from its GGUF file by default): tunix samples with its JAX sampler, kvpage through
:class:`kvpage.integrations.tunix.KvpageRollout`, which reads the module's parameters in
place. The workload is GRPO's: ``--prompts`` prompts, each repeated ``--samples`` times
as separate requests (as tunix's GRPO learner does), ``--max-tokens`` tokens each, at
temperature 1, the prefix cache reset between steps; ``--fixed-length`` makes every sample
run ``--max-tokens`` tokens (equal work for both; with EOS, tok/s also depends on how
early the samples happen to stop, and kvpage's steps shrink as rows finish while
tunix's padded batch does not). Each engine is warmed up on the
same batch first, then timed over ``--steps`` steps.

``--compare-suffix`` also times kvpage drafting each sample's next tokens from earlier
samples and prompts (``speculative_config={"method": "suffix"}``; GRPO's samples of one
prompt share text), once with the drafter's default batch limit (no drafts while more than
``max_running`` = 8 sequences run, where the step is already full) and once drafting at
every batch size (and seats for a drafted row per sequence: ``max_num_seqs`` twice the
batch).

``--long-prompts 1500`` swaps the questions for prompts of ~1,500 tokens (a ledger, then
a question about it), the shape where prefill dominates; ``--compare-grouping`` also times
kvpage with ``group_shared_prefills=False``, where each of a prompt's ``--samples`` copies
prefills it (by default the first copy does and the others reuse its blocks).

Printed: generated tokens/s and the ratio, compiles during the timed steps, the weight
sync (``update_params`` from the trainer's state: time, compiles, arrays copied), peak
RSS, each engine's KV memory, and the agreement of kvpage's sampled logprobs
(``processed_logprobs`` at ``--logprob-temperature``) with a teacher-forced forward of
tunix's own module at that temperature.

tunix 0.1.7's Llama applies RoPE base 1e6 whatever the config says; the bench patches
its ``apply_rope`` to the model's base (SmolLM2: 1e5) so both engines run the trained
model, and passes the same base to kvpage.

Needs ``pip install kvpage[tunix]`` (its own environment: ``scripts/tunix_env.sh``).
"""

from __future__ import annotations

import argparse
import json
import resource
import time
from typing import Any

import numpy as np

from kvpage.bench.rollout_workloads import prompts as make_prompts

SUFFIX_TOKENS = 5
"""Drafted tokens per sequence and step with ``--compare-suffix``."""


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _count_tokens(output: Any) -> int:
    return int(sum(len(t) for t in output.tokens))


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "rollout",
        help="kvpage vs tunix's VanillaRollout as a GRPO rollout engine (needs kvpage[tunix])",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", nargs="?", default=None,
                   help="a .gguf file or HF directory of a Llama model (default: SmolLM2-135M)")
    p.add_argument("--prompts", type=int, default=16, help="distinct prompts per step")
    p.add_argument("--samples", type=int, default=8, help="samples per prompt (GRPO group)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens generated per sample")
    p.add_argument("--max-prompt-length", type=int, default=64,
                   help="tunix's left-padded prompt width")
    p.add_argument("--steps", type=int, default=1, help="timed rollout steps per engine")
    p.add_argument("--logprob-temperature", type=float, default=0.7,
                   help="temperature of the logprob agreement check")
    p.add_argument("--fixed-length", action="store_true",
                   help="every sample runs --max-tokens tokens (EOS set to an id the model "
                        "never samples in practice): equal work for both engines")
    p.add_argument("--long-prompts", type=int, default=None, metavar="TOKENS",
                   help="long prompts of about TOKENS tokens each (a ledger and a question) "
                        "instead of the short questions; --max-prompt-length follows them")
    p.add_argument("--compare-grouping", action="store_true",
                   help="also time kvpage with --no-group-shared-prefills (every copy of a "
                        "prompt prefills it)")
    p.add_argument("--compare-batch-invariant", action="store_true",
                   help="also time kvpage with batch_invariant=True (bitwise-stable "
                        "logprobs) and report its cost")
    p.add_argument("--compare-suffix", action="store_true",
                   help="also time kvpage drafting from earlier samples (speculative method "
                        "suffix) with its default batch limit, and drafting at every batch "
                        "size")
    p.add_argument("--skip-tunix", action="store_true", help="time kvpage only")
    p.add_argument("--json", default=None, help="write the figures to this JSON file")
    p.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        from flax import nnx
        from tunix.models.llama3 import model as tunix_llama
        from tunix.rl import common
        from tunix.rl.rollout import base_rollout
    except ImportError:
        print("kvpage bench rollout needs tunix: pip install 'kvpage[tunix]' "
              "(or bash scripts/tunix_env.sh), then run it with that environment's python")
        return 2
    import jax.numpy as jnp

    from kvpage.integrations.tunix import KvpageRollout, tunix_llama_from_checkpoint
    from kvpage.model.real_models import model_or_smollm2

    path = model_or_smollm2(args.model)
    original_rope = tunix_llama.apply_rope
    try:
        model, tok, config = tunix_llama_from_checkpoint(path)
    except ValueError as err:
        print(f"kvpage bench rollout: {err}")
        return 2
    theta = config.rope.theta
    prompts = make_prompts(tok, args.prompts, args.long_prompts)
    batch = [p for p in prompts for _ in range(args.samples)]
    rows = len(batch)
    longest = max(len(tok.encode(p)) for p in prompts)
    max_prompt_length = max(args.max_prompt_length, -(-longest // 64) * 64)
    cache_size = max_prompt_length + args.max_tokens
    rollout_config = base_rollout.RolloutConfig(
        max_tokens_to_generate=args.max_tokens, temperature=1.0, top_p=1.0,
        max_prompt_length=max_prompt_length, kv_cache_size=cache_size,
        return_logprobs=True,
        eos_tokens=[config.vocab_size - 1] if args.fixed_length
        else list(config.eos_token_ids) or None,
    )
    figures: dict[str, Any] = {"rows": rows, "max_tokens": args.max_tokens,
                               "model": str(path), "fixed_length": args.fixed_length,
                               "prompt_tokens_max": longest}

    # ---- kvpage
    # enough KV for every row's prompt + completion (16-token blocks), not the 4 GiB default
    blocks = rows * (-(-cache_size // 16) + 1) + 64
    engine_args = dict(rope_theta=theta, max_num_seqs=max(rows, 8), num_gpu_blocks=blocks,
                       warmup="full")
    # long prompts: warm up on one group (every bucket compiles at construction anyway)
    warmup_batch = batch[: args.samples] if args.long_prompts else batch
    if args.compare_grouping:
        alone = KvpageRollout(model, tok, None, rollout_config, group_shared_prefills=False,
                              **engine_args)
        timed = _time_kvpage(alone, batch, warmup_batch, rollout_config, args.steps)
        figures["kvpage_ungrouped_tok_s"] = timed["tok_s"]
        figures["kvpage_ungrouped_prompt_tokens"] = timed["prompt_tokens"]
        del alone
    if args.compare_batch_invariant:
        invariant = KvpageRollout(model, tok, None, rollout_config, batch_invariant=True,
                                  **engine_args)
        timed = _time_kvpage(invariant, batch, warmup_batch, rollout_config, args.steps)
        figures["kvpage_invariant_tok_s"] = timed["tok_s"]
        del invariant
    if args.compare_suffix:
        for key, limit in (("suffix", None), ("suffix_any_batch", rows)):
            spec = {"method": "suffix", "num_speculative_tokens": SUFFIX_TOKENS}
            if limit is not None:
                spec["max_running"] = limit
            # Drafted rows are sampled rows: drafting beside `rows` running sequences
            # needs seats for them (`max_num_seqs`).
            seats = {} if limit is None else {"max_num_seqs": 2 * max(rows, 8)}
            drafting = KvpageRollout(model, tok, None, rollout_config, speculative_config=spec,
                                     **{**engine_args, **seats})
            timed = _time_kvpage(drafting, batch, warmup_batch, rollout_config, args.steps)
            figures[f"kvpage_{key}_tok_s"] = timed["tok_s"]
            figures[f"kvpage_{key}_acceptance"] = timed["acceptance"]
            del drafting
    start = time.perf_counter()
    ours = KvpageRollout(model, tok, None, rollout_config, **engine_args)
    figures["kvpage_kv_gib"] = ours.llm.engine.runner.kv_cache_decision.total_bytes / 2**30
    timed = _time_kvpage(ours, batch, warmup_batch, rollout_config, args.steps, start)
    figures["kvpage_warmup_s"] = timed["warmup_s"]
    figures["kvpage_tok_s"] = timed["tok_s"]
    figures["kvpage_compiles_timed"] = timed["compiles"]
    figures["kvpage_prompt_tokens"] = timed["prompt_tokens"]
    if args.compare_batch_invariant:
        figures["invariant_ratio"] = figures["kvpage_invariant_tok_s"] / figures["kvpage_tok_s"]
    if args.compare_grouping:
        figures["grouping_ratio"] = figures["kvpage_tok_s"] / figures["kvpage_ungrouped_tok_s"]
    for key in ("suffix", "suffix_any_batch"):
        if f"kvpage_{key}_tok_s" in figures:
            figures[f"{key}_ratio"] = figures[f"kvpage_{key}_tok_s"] / figures["kvpage_tok_s"]
    figures["peak_rss_after_kvpage_gib"] = _peak_rss_gib()

    # weight sync from the trainer's state (the module's own Params)
    state = nnx.state(model, nnx.Param)
    before_compiles = ours.llm.engine.runner.executables.num_compilations
    t0 = time.perf_counter()
    ours.update_params(state)
    figures["kvpage_sync_ms"] = (time.perf_counter() - t0) * 1e3
    figures["kvpage_sync_arrays_copied"] = ours.llm.engine.runner.last_update_copies
    compiles = ours.llm.engine.runner.executables.num_compilations
    figures["kvpage_sync_compiles"] = compiles - before_compiles

    # logprob agreement: kvpage's processed logprobs vs tunix's teacher-forced forward
    temp = args.logprob_temperature
    check = base_rollout.RolloutConfig(
        max_tokens_to_generate=min(32, args.max_tokens), temperature=temp, top_p=1.0,
        max_prompt_length=max_prompt_length, kv_cache_size=cache_size,
        # the model's own EOS: tunix's teacher-forced pass treats tokens after it as padding
        return_logprobs=True, eos_tokens=list(config.eos_token_ids) or None,
    )
    sample = ours.generate(prompts[: 2 if args.long_prompts else 4], check)
    width = max(1, *(len(t) for t in sample.tokens))  # every sample may stop at once
    completions = np.zeros((len(sample.tokens), width), np.int32)
    for r, t in enumerate(sample.tokens):
        completions[r, : len(t)] = t
    graphdef, graph_state = nnx.split(model)
    forward = np.asarray(common.compute_per_token_logps(
        graphdef, graph_state, jnp.asarray(sample.left_padded_prompt_tokens),
        jnp.asarray(completions), pad_id=ours.pad_id(), eos_id=ours.eos_id(),
        temperature=temp,
    ))
    diffs = [np.abs(lp - forward[r, : len(lp)]).max() for r, lp in enumerate(sample.logprobs)
             if len(lp)]
    figures["logprob_max_abs_diff"] = float(max(diffs)) if diffs else None
    figures["logprob_temperature"] = temp
    del ours

    # ---- tunix
    if not args.skip_tunix:
        try:
            figures.update(_time_tunix(model, tok, config, batch, rollout_config, state,
                                       cache_size, args.steps))
            figures["ratio_tok_s"] = figures["kvpage_tok_s"] / figures["tunix_tok_s"]
        except Exception as e:  # e.g. out of memory on long prompts: say so, keep ours
            figures["tunix_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    figures["peak_rss_gib"] = _peak_rss_gib()
    tunix_llama.apply_rope = original_rope

    _print(figures)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=2)
    return 0


def _time_tunix(model: Any, tok: Any, config: Any, batch: list[str], rollout_config: Any,
                state: Any, cache_size: int, steps: int) -> dict[str, Any]:
    """tunix's ``VanillaRollout`` on the same batch: warm-up, then ``steps`` timed."""
    import jax
    from tunix.rl.rollout import base_rollout, vanilla_rollout

    from kvpage.system.compilation_cache import compile_counts

    rows = len(batch)
    cache = base_rollout.CacheConfig(cache_size=cache_size, num_layers=config.num_layers,
                                     num_kv_heads=config.num_kv_heads, head_dim=config.head_dim)
    theirs = vanilla_rollout.VanillaRollout(model, tok, cache)
    figures: dict[str, Any] = {}
    t0 = time.perf_counter()
    theirs.generate(batch, rollout_config)
    figures["tunix_warmup_s"] = time.perf_counter() - t0
    tokens, elapsed, compiles = 0, 0.0, 0
    for _ in range(steps):
        before = compile_counts()
        t0 = time.perf_counter()
        out = theirs.generate(batch, rollout_config)
        jax.block_until_ready(out.tokens)
        elapsed += time.perf_counter() - t0
        compiles += (compile_counts() - before).compiled
        tokens += _count_tokens(out)
    figures["tunix_tok_s"] = tokens / elapsed
    figures["tunix_compiles_timed"] = compiles
    t0 = time.perf_counter()
    theirs.update_params(state)
    figures["tunix_sync_ms"] = (time.perf_counter() - t0) * 1e3
    figures["tunix_kv_gib"] = (2 * config.num_layers * rows * cache_size
                               * config.num_kv_heads * config.head_dim * 4 / 2**30)
    return figures


def _time_kvpage(ours: Any, batch: list[str], warmup_batch: list[str], rollout_config: Any,
                 steps: int, start: float | None = None) -> dict[str, float]:
    """Warm ``ours`` up, then time ``steps`` rollout steps of ``batch`` (the prefix cache
    reset before each): tok/s, compiles, and prompt tokens computed per step."""
    from kvpage.system.compilation_cache import compile_counts

    start = time.perf_counter() if start is None else start
    ours.generate(warmup_batch, rollout_config)
    figures = {"warmup_s": time.perf_counter() - start}
    engine = ours.llm.engine
    tokens, elapsed, compiles, prompt_tokens = 0, 0.0, 0, 0
    drafted = engine.get_stats().get("spec_decode_num_draft_tokens", 0)
    accepted = engine.get_stats().get("spec_decode_num_accepted_tokens", 0)
    for _ in range(steps):
        ours.llm.reset_prefix_cache()
        before = compile_counts()
        scheduled = engine.get_stats()["prompt_tokens_scheduled"]
        t0 = time.perf_counter()
        output = ours.generate(batch, rollout_config)
        elapsed += time.perf_counter() - t0
        compiles += (compile_counts() - before).compiled
        prompt_tokens += engine.get_stats()["prompt_tokens_scheduled"] - scheduled
        tokens += _count_tokens(output)
    ours.llm.reset_prefix_cache()
    stats = engine.get_stats()
    drafted = stats.get("spec_decode_num_draft_tokens", 0) - drafted
    accepted = stats.get("spec_decode_num_accepted_tokens", 0) - accepted
    figures.update(tok_s=tokens / elapsed, compiles=compiles, prompt_tokens=prompt_tokens / steps,
                   drafted=drafted, acceptance=accepted / drafted if drafted else None)
    return figures


def _print(f: dict[str, Any]) -> None:
    length = "exactly" if f["fixed_length"] else "at most"
    print(f"GRPO rollout: {f['rows']} samples (prompts up to {f['prompt_tokens_max']} tokens) "
          f"x {length} {f['max_tokens']} tokens, temperature 1, {f['model']}")
    line = f"  kvpage {f['kvpage_tok_s']:.1f} tok/s"
    if "tunix_error" in f:
        line += f" | tunix VanillaRollout failed: {f['tunix_error']}"
    if "tunix_tok_s" in f:
        line += (f" | tunix VanillaRollout {f['tunix_tok_s']:.1f} tok/s | "
                 f"ratio {f['ratio_tok_s']:.2f}x")
    print(line)
    if "kvpage_ungrouped_tok_s" in f:
        print(f"  prefill grouping: on {f['kvpage_tok_s']:.1f} tok/s, "
              f"{f['kvpage_prompt_tokens']:.0f} prompt tokens computed | off "
              f"{f['kvpage_ungrouped_tok_s']:.1f} tok/s, "
              f"{f['kvpage_ungrouped_prompt_tokens']:.0f} | ratio {f['grouping_ratio']:.2f}x")
    for key, what in (("suffix", "default batch limit"),
                      ("suffix_any_batch", "drafting at every batch size")):
        if f"kvpage_{key}_tok_s" in f:
            acc = f[f"kvpage_{key}_acceptance"]
            print(f"  suffix drafts ({what}): {f[f'kvpage_{key}_tok_s']:.1f} tok/s, "
                  f"{f[f'{key}_ratio']:.2f}x without drafts, acceptance "
                  + ("- (nothing drafted)" if acc is None else f"{acc:.0%}"))
    if "kvpage_invariant_tok_s" in f:
        print(f"  batch_invariant: {f['kvpage_invariant_tok_s']:.1f} tok/s, "
              f"{f['invariant_ratio']:.2f}x the default engine")
    print(f"  compiles during the timed steps: kvpage {f['kvpage_compiles_timed']}"
          + (f", tunix {f['tunix_compiles_timed']}" if "tunix_compiles_timed" in f else ""))
    print(f"  weight sync: kvpage {f['kvpage_sync_ms']:.2f} ms, "
          f"{f['kvpage_sync_arrays_copied']} arrays copied, {f['kvpage_sync_compiles']} "
          "compiles" + (f" | tunix {f['tunix_sync_ms']:.1f} ms" if "tunix_sync_ms" in f
                        else ""))
    diff = f["logprob_max_abs_diff"]
    print(f"  logprobs (processed, T={f['logprob_temperature']}) vs tunix's teacher-forced "
          "forward: " + ("no token sampled" if diff is None else f"max |diff| {diff:.2e}"))
    print(f"  peak RSS {f['peak_rss_gib']:.2f} GiB (after kvpage's part: "
          f"{f['peak_rss_after_kvpage_gib']:.2f} GiB); KV memory: kvpage "
          f"{f['kvpage_kv_gib']:.2f} GiB"
          + (f", tunix {f['tunix_kv_gib']:.2f} GiB" if "tunix_kv_gib" in f else ""))
