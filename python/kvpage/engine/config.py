"""Engine settings, with vLLM's names; validated with errors naming the field.

Also owns the engine's command-line flags (:func:`add_engine_args`, spelled as vLLM
spells them) and the config they describe (:func:`engine_config_from_args`), shared by
``kvpage generate``, ``serve`` and ``bench``.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields
from typing import Any

from kvpage.engine.kv_events import KVEventsConfig, parse_kv_events_config
from kvpage.engine.speculative_config import SpeculativeConfig, parse_speculative_config
from kvpage.quant.modes import QUANTIZATION_MODES
from kvpage.quant.modes import check_mode as check_quantization

POLICIES = ("fcfs", "priority", "static")
DTYPES = ("auto", "float32", "bfloat16", "float16")
KV_CACHE_DTYPES = DTYPES
WARMUP_MODES = ("none", "background", "full")
CPU_INPUT_BITS = (16, 8)


@dataclass(slots=True)
class EngineConfig:
    """How to run the engine. ``None`` sizes are derived from the model and
    device: ``max_model_len`` from the model's ``max_position_embeddings``,
    ``num_gpu_blocks`` from ``kv_cache_memory`` if given, else from
    ``gpu_memory_utilization`` on an accelerator, else (CPU) enough for
    ``max_num_seqs`` sequences of ``max_model_len`` within a safe share of the
    available RAM (:mod:`kvpage.runner.kv_cache_sizing`)."""

    model: str | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_gpu_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None
    """Bytes for the KV cache; overrides the memory-based sizing."""
    enable_prefix_caching: bool = True
    group_shared_prefills: bool = True
    """A waiting request whose prompt shares whole KV blocks with one being prefilled waits
    for those blocks and reuses them from the prefix cache instead of computing them again
    (``rust/sched/scheduler/prefill_grouping.rs``): GRPO's n copies of a prompt, or a burst
    behind one long system prompt, prefill it once. Needs the prefix cache."""
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None
    dtype: str = "auto"
    quantization: str = "auto"
    """Which weights stay quantized in memory (:mod:`kvpage.quant.modes`): ``"auto"``
    keeps a GGUF file's Q8_0/Q4_0/Q4_1/Q5_0/Q5_1/Q4_K/Q6_K blocks on CPU, ``"none"``
    dequantizes at load, ``"gguf"`` keeps blocks everywhere, ``"int8"`` per-channel int8."""
    kv_cache_dtype: str = "auto"
    """Element type of the KV pools (:func:`kvpage.runner.kv_cache.resolve_kv_cache_dtype`):
    ``"auto"`` is float16 when quantized weights run on CPU (as llama.cpp keeps its cache:
    half the bytes each decode step reads), else the weights' dtype."""
    cpu_input_bits: int = 16
    """Bits a host CPU kernel keeps of each input to a quantized (GGUF) product, per block
    of 32: 16, or 8 for llama.cpp's numerics (its ``q8`` inputs), which halves the packed
    4-bit kernels' multiply-adds at an input rounding of ~4e-3 instead of ~1.5e-5 (near-tied
    greedy tokens can flip). Process-wide: the last engine built sets it."""
    num_scheduler_steps: int | None = None
    """Most decode steps one device call runs (multi-step scheduling,
    :mod:`kvpage.runner.multi_step`): small pure-decode batches sample several tokens per
    call, so the host's dispatch is paid once per call. None: 8 on CPU, else 1. Its
    executables compile with the step buckets under ``warmup="full"``, after them under
    ``"background"``; under ``"none"`` they are never compiled and every step runs alone."""
    scheduling_policy: str = "fcfs"
    attention_backend: str | None = None
    tensor_parallel_size: int = 1
    seed: int = 0
    long_prefill_token_threshold: int = 0
    max_num_waiting: int | None = None
    """Bound of the waiting queue: add_request raises QueueFullError past it."""
    max_logprobs: int = 20
    overlap_host_work: bool = True
    """Detokenize step t while the device runs step t + 1."""
    warmup: str = "none"
    """When step buckets compile: ``"none"`` on first use (a step waits only for its
    own bucket), ``"background"`` on a background thread from startup while requests
    already run (``kvpage serve``'s default), ``"full"`` all at startup before the first
    request (a progress bar). ``True`` / ``False`` mean ``"full"`` / ``"none"``."""
    compilation_cache_dir: str | None = "auto"
    """JAX's persistent compilation cache, so a restart compiles nothing: ``"auto"`` is
    ``$XDG_CACHE_HOME/kvpage/xla`` (``~/.cache/kvpage/xla``), a path uses that directory,
    None turns it off. A cache the process already configured is left alone."""

    enable_lora: bool = False
    """Serve LoRA adapters (:mod:`kvpage.lora`): requests name one with a
    :class:`~kvpage.lora.LoRARequest`; up to ``max_loras`` are resident at once, mixed
    within a step, of rank up to ``max_lora_rank``."""
    max_loras: int = 1
    max_lora_rank: int = 16
    batch_invariant: bool = False
    """A sample's tokens and logprobs are bitwise identical whatever else shares its
    steps, and equal to ``LLM.score`` of the same tokens (CPU, one device, float32 or
    GGUF-quantized weights): every product and the attention run kernels whose result
    for a token depends on that token's inputs only. Costs speed (docs/rollouts.md)."""

    speculative_config: SpeculativeConfig | dict[str, Any] | str | None = None
    """Speculative decoding (vLLM's ``--speculative-config``, :mod:`kvpage.engine.\
speculative_config`): e.g. ``{"method": "ngram", "num_speculative_tokens": 15}``; a dict or
    its JSON text becomes a :class:`SpeculativeConfig`. None: off."""
    kv_events_config: KVEventsConfig | dict[str, Any] | str | None = None
    """Publish what the prefix cache stores and drops for cache-aware routers (vLLM's
    ``--kv-events-config``, :mod:`kvpage.engine.kv_events`): e.g.
    ``{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:5557"}``.
    None: off."""

    def __post_init__(self) -> None:
        self.speculative_config = parse_speculative_config(self.speculative_config)
        self.kv_events_config = parse_kv_events_config(self.kv_events_config)

        def positive(name: str, upper: int = 1 << 24) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= upper:
                raise ValueError(f"{name} must be an integer in [1, {upper}], got {value!r}")

        positive("max_num_seqs", 1 << 16)
        positive("max_num_batched_tokens")
        positive("block_size", 1024)
        positive("tensor_parallel_size", 4096)
        positive("max_loras", 1024)
        positive("max_lora_rank", 1024)
        if self.num_gpu_blocks is not None:
            positive("num_gpu_blocks", (1 << 31) - 2)
        if self.max_model_len is not None:
            positive("max_model_len")
        if self.kv_cache_memory is not None:
            positive("kv_cache_memory", 1 << 50)
        if self.max_num_waiting is not None:
            positive("max_num_waiting", 1 << 24)
        if self.num_scheduler_steps is not None:
            positive("num_scheduler_steps", 1024)
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}"
            )
        if self.scheduling_policy not in POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {POLICIES}, got {self.scheduling_policy!r}"
            )
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}"
            )
        check_quantization(self.quantization)
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be >= 0 (0 = no cap), got "
                f"{self.long_prefill_token_threshold!r}"
            )
        if isinstance(self.warmup, bool):
            self.warmup = "full" if self.warmup else "none"
        if self.warmup not in WARMUP_MODES:
            raise ValueError(f"warmup must be one of {WARMUP_MODES}, got {self.warmup!r}")
        if self.cpu_input_bits not in CPU_INPUT_BITS:
            raise ValueError(
                f"cpu_input_bits must be one of {CPU_INPUT_BITS}, got {self.cpu_input_bits!r}"
            )
        if not 0 <= self.max_logprobs <= 1024:
            raise ValueError(f"max_logprobs must be in [0, 1024], got {self.max_logprobs!r}")

    # ---- what the settings come to for one model --------------------------------

    def resolve_max_model_len(self, max_position_embeddings: int) -> int:
        """``max_model_len`` for a model of ``max_position_embeddings`` positions: the
        model's own when unset, and never more."""
        max_model_len = self.max_model_len or max_position_embeddings
        if max_model_len > max_position_embeddings:
            raise ValueError(
                f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
                f"{max_position_embeddings}"
            )
        return max_model_len

    @property
    def max_sampled_rows(self) -> int:
        """Most sampled rows a step carries: ``max_num_seqs``, or one more than the drafted
        tokens when that is larger, so that one sequence verifies all its drafts whatever
        ``max_num_seqs`` is (the Rust scheduler's ``SchedulerConfig::max_sampled_rows``)."""
        spec = self.speculative_config
        drafts = spec.num_speculative_tokens if isinstance(spec, SpeculativeConfig) else 0
        return max(self.max_num_seqs, 1 + drafts)

    def step_token_budget(self, max_model_len: int) -> int:
        """Most tokens one step carries (the scheduler's and the runner's
        ``max_num_batched_tokens``): ``max_num_batched_tokens``, at least one per
        sequence and, without chunked prefill, a whole prompt."""
        budget = max(self.max_num_batched_tokens, self.max_num_seqs)
        return budget if self.enable_chunked_prefill else max(budget, max_model_len)

    def check_logprobs(self, logprobs: int | None, prompt_logprobs: int | None) -> None:
        """A request's ``logprobs`` and ``prompt_logprobs`` within ``max_logprobs``."""
        for name, value in (("logprobs", logprobs), ("prompt_logprobs", prompt_logprobs)):
            if value is not None and value > self.max_logprobs:
                raise ValueError(
                    f"{name} must be <= {self.max_logprobs} (max_logprobs), got {value}"
                )


# ---- the engine's command-line flags (kvpage generate / serve / bench) ----------


def _byte_size(text: str) -> int:
    """``"4G"``, ``"512M"``, ``"1.5GiB"`` or plain bytes."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    value = text.strip().upper().removesuffix("IB").removesuffix("B")
    suffix = value[-1:] if value[-1:] in units and value[-1:] else ""
    try:
        number = float(value[: len(value) - len(suffix)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 4G, 512M)") from None
    if number <= 0:
        raise argparse.ArgumentTypeError(f"byte size must be positive, got {text!r}")
    return int(number * units[suffix])


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """The engine flags, with vLLM's spellings."""
    g = parser.add_argument_group("engine")
    d = EngineConfig()
    g.add_argument(
        "--max-num-seqs",
        type=int,
        default=d.max_num_seqs,
        help="most sequences running at once (the continuous batch width)",
    )
    g.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=d.max_num_batched_tokens,
        help="token budget of one step (prefill chunks + decodes)",
    )
    g.add_argument("--block-size", type=int, default=d.block_size, help="tokens per KV block")
    g.add_argument(
        "--num-gpu-blocks",
        type=int,
        default=d.num_gpu_blocks,
        help="KV blocks in the pool (default: from --kv-cache-memory, else from the memory "
        "the device or host has)",
    )
    g.add_argument(
        "--kv-cache-memory",
        type=_byte_size,
        default=d.kv_cache_memory,
        help="bytes for the KV cache, e.g. 4G or 512M (overrides the memory-based sizing)",
    )
    g.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=d.gpu_memory_utilization,
        help="fraction of accelerator memory for params, activations and the KV cache",
    )
    g.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=d.enable_prefix_caching,
        help="reuse KV of shared prompt prefixes",
    )
    g.add_argument(
        "--enable-lora",
        action=argparse.BooleanOptionalAction,
        default=d.enable_lora,
        help="serve LoRA adapters (requests name one; see --lora-modules)",
    )
    g.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=d.batch_invariant,
        help="bitwise-identical outputs whatever else shares a step (CPU; slower)",
    )
    g.add_argument("--max-loras", type=int, default=d.max_loras,
                   help="LoRA adapters resident at once (mixed within a step)")
    g.add_argument("--max-lora-rank", type=int, default=d.max_lora_rank,
                   help="largest LoRA rank an adapter may have")
    g.add_argument(
        "--group-shared-prefills",
        action=argparse.BooleanOptionalAction,
        default=d.group_shared_prefills,
        help="requests whose prompts share blocks with one being prefilled wait for it and "
        "reuse its KV instead of computing the same prefix again",
    )
    g.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=d.enable_chunked_prefill,
        help="split long prompts across steps so decodes keep flowing",
    )
    g.add_argument(
        "--long-prefill-token-threshold",
        type=int,
        default=d.long_prefill_token_threshold,
        help="most tokens one prompt may take in a step (0 = no cap)",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=d.max_model_len,
        help="longest sequence, prompt + output (default: the model's)",
    )
    g.add_argument("--dtype", default=d.dtype, choices=DTYPES, help="weight dtype")
    g.add_argument(
        "--quantization",
        default=d.quantization,
        choices=QUANTIZATION_MODES,
        help="weights kept quantized: auto (a GGUF file's blocks on CPU), none "
        "(dequantize at load), gguf (blocks everywhere), int8 (per-channel int8)",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default=d.kv_cache_dtype,
        choices=KV_CACHE_DTYPES,
        help="KV cache element type: auto (float16 with quantized weights on CPU, else the "
        "weights' dtype), float32, bfloat16 or float16",
    )
    g.add_argument(
        "--cpu-input-bits",
        type=int,
        default=d.cpu_input_bits,
        choices=CPU_INPUT_BITS,
        help="bits the CPU kernels keep of each input to a quantized product: 16, or 8 "
        "(llama.cpp's numerics: faster 4-bit products, inputs rounded to ~4e-3)",
    )
    g.add_argument(
        "--num-scheduler-steps",
        type=int,
        default=d.num_scheduler_steps,
        help="most decode steps one device call runs for a small decode batch (default: 8 "
        "on CPU, 1 elsewhere; 1 turns multi-step scheduling off)",
    )
    g.add_argument(
        "--scheduling-policy",
        default=d.scheduling_policy,
        choices=POLICIES,
        help="fcfs, priority (lower value first), or static (baseline)",
    )
    g.add_argument(
        "--attention-backend",
        default=d.attention_backend,
        help="xla, pallas or reference (default: pallas on GPU, xla elsewhere)",
    )
    g.add_argument("--tensor-parallel-size", type=int, default=d.tensor_parallel_size,
                   help="devices to shard over")
    g.add_argument(
        "--max-num-waiting",
        type=int,
        default=d.max_num_waiting,
        help="bound of the waiting queue (serve answers 503 past it)",
    )
    g.add_argument(
        "--max-logprobs",
        type=int,
        default=d.max_logprobs,
        help="largest logprobs a request may ask for",
    )
    g.add_argument("--seed", type=int, default=d.seed, help="engine seed")
    g.add_argument(
        "--speculative-config", default=None, metavar="JSON",
        help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 15, '
        '"prompt_lookup_max": 4}\', or \'{"method": "draft_model", "model": "DRAFT"}\' '
        '(default: off)',
    )
    g.add_argument(
        "--warmup", nargs="?", const="full", default=None, choices=WARMUP_MODES,
        help="when step buckets compile: none (on first use; generate's default), "
        "background (from startup, while requests already run; serve's default) or full "
        "(all before the first request; --warmup alone)",
    )
    g.add_argument("--no-warmup", dest="warmup", action="store_const", const="none",
                   help="same as --warmup none")
    g.add_argument(
        "--compilation-cache-dir", default=d.compilation_cache_dir, metavar="DIR",
        help="persistent XLA compilation cache, so a restart compiles nothing (default: "
        "$XDG_CACHE_HOME/kvpage/xla, i.e. ~/.cache/kvpage/xla); 'none' turns it off",
    )


def engine_config_from_args(args: argparse.Namespace, model: str) -> EngineConfig:
    """The config the flags of :func:`add_engine_args` describe."""
    names = {f.name for f in fields(EngineConfig)} - {"model"}
    values = {n: getattr(args, n) for n in names if hasattr(args, n)}
    if values.get("warmup") is None:
        values.pop("warmup", None)
    if str(values.get("compilation_cache_dir", "auto")).lower() in ("none", "off", ""):
        values["compilation_cache_dir"] = None
    return EngineConfig(model=model, **values)
