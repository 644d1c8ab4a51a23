"""Shared pieces of the benchmarks: building an engine (from a model
directory or from random weights at a real model's shape), driving it over a
list of requests while recording what the scheduler did, tables, and JSON.

The driver, :func:`run_requests`, is the one loop every offline benchmark
uses: it keeps at most ``max_concurrency`` requests inside the engine (as a
client-side concurrency limit would), steps the engine until all finish, and
measures wall-clock throughput, per-request latency, KV blocks in use over
time and the scheduler's slot efficiency and KV waste.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from kvpage.engine.config import EngineConfig
    from kvpage.engine.llm_engine import LLMEngine

TINY_MODEL_DIR = Path.home() / ".cache" / "kvpage" / "tiny-llama"
"""Where the benchmarks build their default model, the tiny random Llama."""
LENGTH_MODES = ("exact", "eos", "cap")
"""How a request's output length is enforced:

``exact``: ``max_tokens`` = the drawn length and ``ignore_eos`` (the engine
knows each length up front; static batching then reserves exactly it).
``eos``: ``max_tokens`` = the drawn length, the model may stop earlier at EOS.
``cap``: the request asks for ``max_tokens`` up to ``max_model_len`` (as a user
who does not know the answer's length does) and ends at the drawn length as
if the model had emitted EOS there. Random weights never emit EOS on cue, so
from the drawn length on every token id but one counts as a stop token
(``min_tokens`` = drawn length, ``stop_token_ids``)."""


# ---- output -----------------------------------------------------------------


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]], title: str = "") -> str:
    """A plain-text table; floats get 3 significant decimals."""

    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            if math.isnan(value):
                return "-"
            return f"{value:,.3f}" if abs(value) < 100 else f"{value:,.1f}"
        return str(value)

    text = [[cell(v) for v in row] for row in rows]
    widths = [
        max([len(h)] + [len(r[i]) for r in text]) for i, h in enumerate(headers)
    ]
    lines = []
    if title:
        lines.append(title)
    lines.append("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
    lines.append("  ".join("-" * w for w in widths))
    for row in text:
        lines.append("  ".join(v.rjust(w) for v, w in zip(row, widths, strict=True)))
    return "\n".join(lines)


def write_json(path: str | Path, payload: Any) -> Path:
    """Write ``payload`` as indented JSON (numpy scalars converted)."""

    def default(value: Any) -> Any:
        if isinstance(value, np.integer):
            return int(value)
        if isinstance(value, np.floating):
            return float(value)
        if isinstance(value, np.ndarray):
            return value.tolist()
        raise TypeError(f"not JSON serializable: {type(value).__name__}")

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2, default=default) + "\n")
    return path


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100, linear interpolation); None for no values.

    The one percentile of the benchmarks and the load test.
    """
    return float(np.percentile(values, q)) if len(values) else None


def mean(values: Sequence[float]) -> float:
    return float(np.mean(values)) if len(values) else float("nan")


# ---- engines ----------------------------------------------------------------


def default_model_dir() -> str:
    """The benchmarks' default model: the tiny random Llama of
    :mod:`kvpage.model.tiny_model` (2 layers, hidden 64, vocab 512), built on first
    use at :data:`TINY_MODEL_DIR`. Fixed, so figures stay comparable."""
    if not (TINY_MODEL_DIR / "config.json").is_file():
        from kvpage.model.tiny_model import build_tiny_model

        print(f"building a tiny random Llama at {TINY_MODEL_DIR} ...", file=sys.stderr)
        build_tiny_model(TINY_MODEL_DIR)
    return str(TINY_MODEL_DIR)


def random_weights_config(spec: str) -> Any:
    """A ``ModelConfig`` from a preset name (``kvpage.model.presets``), an HF
    ``config.json`` file or a directory holding one."""
    from kvpage.model.config import ModelConfig
    from kvpage.model.presets import PRESETS, preset

    if spec in PRESETS:
        return preset(spec)
    path = Path(spec)
    if path.is_dir() and (path / "config.json").is_file():
        return ModelConfig.from_pretrained(path)
    if path.is_file():
        return ModelConfig.from_json_file(path)
    raise ValueError(
        f"--random-weights {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a "
        "config.json file or directory"
    )


@dataclass(slots=True)
class LoadedModel:
    """Weights and config loaded once, from which several engines are built."""

    model_config: Any
    params: Any
    tokenizer: Any
    model_dir: Path | None
    source: str

    @property
    def vocab_size(self) -> int:
        return int(self.model_config.vocab_size)


def load(model: str | None, random_weights: str | None = None, dtype: str = "auto",
         seed: int = 0) -> LoadedModel:
    """Load ``model`` (an HF directory or a .gguf file; default: the tiny model) or
    random weights at the shape named by ``random_weights`` (no tokenizer then:
    prompts are token ids)."""
    if random_weights:
        from kvpage.model.loader import random_params

        config = random_weights_config(random_weights)
        params = random_params(config, seed=seed, dtype=dtype)
        return LoadedModel(config, params, None, None, f"random weights: {random_weights}")
    from kvpage.engine.llm_engine import load_model_and_tokenizer

    source = model or default_model_dir()
    config, params, tokenizer, model_dir = load_model_and_tokenizer(source, dtype=dtype)
    return LoadedModel(config, params, tokenizer, model_dir, str(source))


def build_engine(loaded: LoadedModel, config: EngineConfig, warmup: bool = True) -> LLMEngine:
    """An engine over already loaded weights; ``warmup`` compiles every step
    bucket first, so compilation stays out of the timed run."""
    from kvpage.engine.llm_engine import LLMEngine

    if "warmup" in getattr(config, "__dataclass_fields__", {}):
        config = replace(config, warmup=False)  # warmed up below, without a progress bar
    engine = LLMEngine(config, loaded.model_config, loaded.params, loaded.tokenizer,
                       loaded.model_dir)
    if warmup:
        engine.runner.warmup(progress=False, max_workers=min(4, os.cpu_count() or 1))
    return engine


# ---- workloads ----------------------------------------------------------------


@dataclass(slots=True)
class BenchRequest:
    """One request: prompt token ids, the output length wanted and, for
    online runs, when to send it (seconds from the start)."""

    prompt_token_ids: list[int]
    output_len: int
    arrival: float = 0.0


def fit_to_model_len(
    requests: Sequence[BenchRequest], max_model_len: int
) -> tuple[list[BenchRequest], int]:
    """Shorten requests that would not fit ``max_model_len`` (the output to at
    most half of it, then the prompt); returns them and how many changed."""
    fitted, changed = [], 0
    for r in requests:
        out = min(r.output_len, max(1, max_model_len // 2))
        prompt = r.prompt_token_ids[: max(1, max_model_len - out)]
        if out != r.output_len or len(prompt) != len(r.prompt_token_ids):
            changed += 1
        fitted.append(BenchRequest(prompt, out, r.arrival))
    return fitted, changed


def synthetic_requests(
    num_requests: int,
    *,
    dataset: str = "random",
    input_len: int = 230,
    output_len: int = 200,
    range_ratio: float = 0.0,
    prefix_len: int = 0,
    vocab_size: int = 32000,
    seed: int = 0,
    output_lens: Sequence[int] | None = None,
    request_rate: float = float("inf"),
) -> list[BenchRequest]:
    """Requests from :func:`kvpage.bench.workload.make_workload`.

    ``random``: lengths fixed at the means, or uniform within mean*(1 +/-
    ``range_ratio``); ``sharegpt``: the long-tailed ShareGPT-like draw (means
    ``input_len``/``output_len``, default 230/200). ``prefix_len`` tokens
    shared by every prompt. Token ids are drawn from [10, ``vocab_size``).
    Arrivals are Poisson at ``request_rate`` per second (inf: all at 0)."""
    from kvpage.bench.workload import make_workload

    if dataset == "random":
        dist = "uniform" if range_ratio > 0 else "fixed"
    elif dataset == "sharegpt":
        dist = "sharegpt"
    else:
        raise ValueError(f"dataset must be 'random' or 'sharegpt', got {dataset!r}")
    work = make_workload(
        num_requests,
        input_len=input_len,
        output_len=output_len,
        dist=dist,
        range_ratio=range_ratio,
        shared_prefix_len=prefix_len,
        vocab_size=max(vocab_size - 7, 1),
        seed=seed,
        output_lens=list(output_lens) if output_lens is not None else None,
        request_rate=request_rate,
    )
    # make_workload draws ids from [3, vocab); shift past special tokens.
    return [
        BenchRequest([t + 7 for t in r.prompt_token_ids], r.output_len, r.arrival)
        for r in work
    ]


def log_uniform_lengths(n: int, low: int, high: int, seed: int = 0) -> list[int]:
    """``n`` lengths spread evenly in log space between ``low`` and ``high``
    (the 'one request wants 20 tokens, another 800' workload)."""
    rng = np.random.default_rng(seed)
    draws = np.exp(rng.uniform(np.log(low), np.log(high), size=n))
    return np.clip(np.round(draws), low, high).astype(int).tolist()


# ---- the driver -------------------------------------------------------------------


@dataclass(slots=True)
class RunResult:
    """What one offline run through the engine measured."""

    policy: str
    num_requests: int
    max_concurrency: int
    elapsed_s: float
    prompt_tokens: int
    output_tokens: int
    steps: int
    requests_per_s: float
    total_tokens_per_s: float
    output_tokens_per_s: float
    mean_latency_s: float
    p99_latency_s: float
    mean_ttft_s: float
    slot_efficiency: float
    """Output tokens / seat-steps (``steps x max_num_seqs``), as in the seeds."""
    seat_utilization: float
    """Rows run (static ghosts included) / seat-steps."""
    kv_waste: float
    """Reserved-but-unused KV slots / reserved slots, averaged over steps."""
    mean_running: float
    max_running: int
    max_kv_blocks: int
    num_kv_blocks: int
    preemptions: int
    lengths_as_drawn: int
    """Requests whose output had exactly the drawn length."""
    timing: dict[str, float]
    timeline_s: list[float] = field(default_factory=list)
    timeline_kv_blocks: list[int] = field(default_factory=list)
    """KV blocks held by live sequences after each step."""
    timeline_kv_filled: list[float] = field(default_factory=list)
    """KV slots holding computed tokens after each step, in blocks."""

    def summary(self) -> dict[str, Any]:
        """Everything but the timelines."""
        return {
            k: getattr(self, k)
            for k in self.__slots__  # type: ignore[attr-defined]
            if not k.startswith("timeline")
        }


def _params_for(
    request: BenchRequest, mode: str, max_model_len: int, vocab_size: int
) -> Any:
    from kvpage.sampling.params import SamplingParams

    if mode == "exact":
        return SamplingParams(max_tokens=request.output_len, ignore_eos=True)
    if mode == "eos":
        return SamplingParams(max_tokens=request.output_len)
    if mode == "cap":
        cap = max_model_len - len(request.prompt_token_ids)
        want = min(request.output_len, cap)
        # Every token but 0 stops the request once min_tokens are out (the device masks
        # them before), so the drawn length's last token is its stop token; token 0 is
        # left out so the mask never covers every logit.
        return SamplingParams(
            max_tokens=cap, min_tokens=max(want - 1, 0),
            stop_token_ids=list(range(1, vocab_size)), ignore_eos=True,
        )
    raise ValueError(f"length mode must be one of {LENGTH_MODES}, got {mode!r}")


def run_requests(
    engine: LLMEngine,
    requests: Sequence[BenchRequest],
    *,
    mode: str = "exact",
    max_concurrency: int | None = None,
    record: bool = True,
    time_limit_s: float | None = None,
) -> RunResult:
    """Run ``requests`` (all arriving at once) to completion; at most
    ``max_concurrency`` are inside the engine at any time.

    ``record``: read the scheduler's counters after every step (KV blocks in
    use, reserved vs used KV slots). ``time_limit_s``: raise if exceeded."""
    from kvpage.engine.llm_engine import StepTiming

    if engine.has_unfinished_requests():
        raise ValueError("the engine must be idle")
    vocab = int(engine.model_config.vocab_size)
    limit = max_concurrency or len(requests)
    before = dict(engine.scheduler.stats())
    engine.timing = StepTiming()
    params = [_params_for(r, mode, engine.max_model_len, vocab) for r in requests]
    t0 = time.perf_counter()
    next_index, in_flight = 0, 0
    finished: dict[str, Any] = {}
    timeline_s: list[float] = []
    timeline_blocks: list[int] = []
    timeline_filled: list[float] = []
    running: list[int] = []
    waste: list[float] = []
    while len(finished) < len(requests):
        while next_index < len(requests) and in_flight < limit:
            r = requests[next_index]
            engine.add_request(
                f"bench-{next_index}", {"prompt_token_ids": r.prompt_token_ids},
                params[next_index],
            )
            next_index += 1
            in_flight += 1
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
                in_flight -= 1
        if record:
            stats = engine.scheduler.stats()
            timeline_s.append(time.perf_counter() - t0)
            timeline_blocks.append(int(stats["num_referenced_blocks"]))
            running.append(int(stats["last_step_seqs"]))
            reserved, used = stats["kv_slots_reserved"], stats["kv_slots_used"]
            timeline_filled.append(used / engine.config.block_size)
            if reserved:
                waste.append(1.0 - used / reserved)
        if time_limit_s is not None and time.perf_counter() - t0 > time_limit_s:
            engine.abort_request([f"bench-{i}" for i in range(next_index)])
            raise TimeoutError(f"the run exceeded {time_limit_s:.0f} s")
    elapsed = time.perf_counter() - t0
    after = engine.scheduler.stats()
    outputs = [finished[f"bench-{i}"] for i in range(len(requests))]
    failed = [o for o in outputs if o.error]
    if failed:
        raise RuntimeError(
            f"{len(failed)} of {len(outputs)} requests failed; the first: {failed[0].error}"
        )
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    latencies = [o.metrics.finished_time - o.metrics.arrival_time for o in outputs]
    ttfts = [
        o.metrics.first_token_time - o.metrics.arrival_time
        for o in outputs
        if o.metrics.first_token_time is not None
    ]
    rows = after["seq_rows"] - before["seq_rows"]
    steps = after["num_steps"] - before["num_steps"]
    seat_steps = steps * engine.config.max_num_seqs
    drawn = sum(
        len(o.outputs[0].token_ids) == min(r.output_len, engine.max_model_len
                                           - len(r.prompt_token_ids))
        for o, r in zip(outputs, requests, strict=True)
    )
    return RunResult(
        policy=engine.config.scheduling_policy,
        num_requests=len(requests),
        max_concurrency=limit,
        elapsed_s=elapsed,
        prompt_tokens=prompt_tokens,
        output_tokens=output_tokens,
        steps=steps,
        requests_per_s=len(requests) / elapsed,
        total_tokens_per_s=(prompt_tokens + output_tokens) / elapsed,
        output_tokens_per_s=output_tokens / elapsed,
        mean_latency_s=mean(latencies),
        p99_latency_s=percentile(latencies, 99),
        mean_ttft_s=mean(ttfts),
        slot_efficiency=output_tokens / seat_steps if seat_steps else float("nan"),
        seat_utilization=rows / seat_steps if seat_steps else float("nan"),
        kv_waste=mean(waste),
        mean_running=mean(running),
        max_running=max(running, default=0),
        max_kv_blocks=max(timeline_blocks, default=0),
        num_kv_blocks=int(engine.runner.num_blocks),
        preemptions=after["num_preemptions"] - before["num_preemptions"],
        lengths_as_drawn=int(drawn),
        timing=engine.timing.as_dict(),
        timeline_s=timeline_s,
        timeline_kv_blocks=timeline_blocks,
        timeline_kv_filled=timeline_filled,
    )
