"""Engine settings, with vLLM's names; validated with errors naming the field."""

from __future__ import annotations

from dataclasses import dataclass

POLICIES = ("fcfs", "priority", "static")
DTYPES = ("auto", "float32", "bfloat16", "float16")


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
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None
    dtype: str = "auto"
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
    warmup: bool = False
    """Compile every step bucket at startup (with a progress bar) instead of
    on first use; servers want it, one-off scripts usually do not."""
    compilation_cache_dir: str | None = "~/.cache/kvpage/xla"
    """JAX's persistent compilation cache, so a restart skips compiles;
    None leaves JAX's own setting alone."""

    def __post_init__(self) -> None:
        def positive(name: str, upper: int = 1 << 24) -> None:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= upper:
                raise ValueError(f"{name} must be an integer in [1, {upper}], got {value!r}")

        positive("max_num_seqs", 1 << 16)
        positive("max_num_batched_tokens")
        positive("block_size", 1024)
        positive("tensor_parallel_size", 4096)
        if self.num_gpu_blocks is not None:
            positive("num_gpu_blocks", (1 << 31) - 2)
        if self.max_model_len is not None:
            positive("max_model_len")
        if self.kv_cache_memory is not None:
            positive("kv_cache_memory", 1 << 50)
        if self.max_num_waiting is not None:
            positive("max_num_waiting", 1 << 24)
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
        if self.long_prefill_token_threshold < 0:
            raise ValueError(
                "long_prefill_token_threshold must be >= 0 (0 = no cap), got "
                f"{self.long_prefill_token_threshold!r}"
            )
        if not 0 <= self.max_logprobs <= 1024:
            raise ValueError(f"max_logprobs must be in [0, 1024], got {self.max_logprobs!r}")
