"""kvpage: an LLM inference engine for JAX.

Continuous batching and PagedAttention, with the scheduler, block pool,
copy-on-write page tables and radix prefix cache in Rust (``kvpage._core``).
"""

from kvpage._core import BlockPool, KVCacheManager, KVPageError

__all__ = ["BlockPool", "KVCacheManager", "KVPageError"]
__version__ = "0.1.0"
