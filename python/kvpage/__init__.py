"""kvpage: an LLM inference engine for JAX.

Continuous batching and PagedAttention, with the scheduler, block pool,
copy-on-write page tables and radix prefix cache in Rust (``kvpage._core``)
and the model runner in JAX.

    from kvpage import LLM, SamplingParams
"""

from kvpage._core import BlockPool, KVCacheManager, KVPageError, Scheduler

__version__ = "0.1.0"

_LAZY = {
    "LLM": "kvpage.llm",
    "LLMEngine": "kvpage.engine.llm_engine",
    "EngineConfig": "kvpage.engine.config",
    "SamplingParams": "kvpage.sampling.params",
    "RequestOutput": "kvpage.outputs",
    "CompletionOutput": "kvpage.outputs",
    "StructuredOutputsParams": "kvpage.structured_outputs.params",
    "GuidedDecodingParams": "kvpage.structured_outputs.params",
    "LoRARequest": "kvpage.lora.request",
}

__all__ = ["BlockPool", "KVCacheManager", "KVPageError", "Scheduler", *_LAZY]


def __getattr__(name: str):  # the JAX side loads on first use, not on import
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'kvpage' has no attribute {name!r}")
