"""How many KV blocks the pool gets: the one place that decides it, and says why.

Policy, in order:

1. ``num_blocks`` given (``num_gpu_blocks``): exactly that many.
2. ``kv_cache_memory`` given (bytes, ``--kv-cache-memory``): as many blocks as fit in it.
3. An accelerator that reports memory: ``memory_utilization`` of its memory, minus what
   is already in use (the params), minus the largest step's activations
   (:func:`step_activation_bytes`), as vLLM profiles before sizing its cache.
4. CPU (or a device without memory statistics): enough for ``max_num_seqs`` sequences
   of ``max_model_len`` tokens, but never more than :func:`cpu_kv_budget`:
   :data:`CPU_KV_MEMORY_FRACTION` of the machine's *total* memory, at most
   :data:`CPU_KV_MEMORY_CAP` (vLLM's CPU default), in whole GiB. That budget is the same
   at every start on a machine, so the pool's shape -- part of every compiled
   executable -- is too, and a restart hits the persistent compilation cache (sizing from
   the moment's *available* memory gave 7,774 blocks one start and 8,056 the next). Only
   when the budget exceeds half of what is available now is it halved until it fits
   (logged: that start then compiles for its smaller pool).

Whatever the route, the pool must hold at least one ``max_model_len`` sequence, or the
configuration is refused with a :class:`ValueError` that names the numbers and the way
out. The decision is logged at startup (blocks, bytes, tokens of capacity).
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from kvpage.model.config import ModelConfig
from kvpage.model.params import Params
from kvpage.runner.kv_cache import KVCacheSpec, resolve_kv_cache_dtype

logger = logging.getLogger("kvpage.kv_cache")

CPU_KV_MEMORY_FRACTION = 0.25
"""Most of the host's total memory a default CPU pool may take."""

CPU_KV_MEMORY_CAP = 4 << 30
"""Largest default CPU pool (bytes): 4 GiB, as vLLM's ``VLLM_CPU_KVCACHE_SPACE``. Zero-
filling the pool is part of every start (about 1 GB/s here); more needs
``--kv-cache-memory``."""

GIB = 1 << 30


@dataclass(frozen=True, slots=True)
class KVCacheDecision:
    num_blocks: int
    bytes_per_block: int
    block_size: int
    reason: str

    @property
    def total_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        return (
            f"KV cache: {self.num_blocks} blocks x {self.block_size} tokens = "
            f"{self.capacity_tokens} tokens, {self.total_bytes / GIB:.2f} GiB ({self.reason})"
        )


def _meminfo_bytes(field: str, pages: str) -> int | None:
    """``field`` of /proc/meminfo, else ``os.sysconf(pages)`` pages; None when unknown."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf(pages) * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def host_total_bytes() -> int | None:
    """The machine's physical memory (``MemTotal``)."""
    return _meminfo_bytes("MemTotal", "SC_PHYS_PAGES")


def host_available_bytes() -> int | None:
    """What the OS can hand out now without swapping (``MemAvailable``)."""
    return _meminfo_bytes("MemAvailable", "SC_AVPHYS_PAGES")


def cpu_kv_budget(total: int | None, available: int | None) -> tuple[int | None, str]:
    """Bytes a default CPU pool may take and why (see the module docstring); None when
    the machine's memory is unknown."""
    if total is None:
        return None, "host memory unknown"
    budget = min(int(total * CPU_KV_MEMORY_FRACTION), CPU_KV_MEMORY_CAP) // GIB * GIB
    budget = max(budget, GIB // 4)
    reason = (
        f"min({CPU_KV_MEMORY_FRACTION:.0%} of {total / GIB:.1f} GiB host memory, "
        f"{CPU_KV_MEMORY_CAP / GIB:.0f} GiB)"
    )
    if available is not None and budget > available // 2:
        while budget > available // 2 and budget > GIB // 4:
            budget //= 2
        reason += f", halved to fit {available / GIB:.1f} GiB available now"
        logger.warning("little host memory available: KV cache budget %s", reason)
    return budget, reason


def step_activation_bytes(
    config: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int, itemsize: int
) -> int:
    """An upper estimate of one step's scratch: a few live ``[T, width]`` activations of
    the widest layer (MLP), the attention tiles, and float32 logits plus the sampler's
    copies at every sampled row. Attention scratch does not grow with ``max_model_len``
    (the attention backends loop over live KV chunks)."""
    tokens, seqs = max_num_batched_tokens, max_num_seqs
    width = max(config.intermediate_size, config.q_size + 2 * config.kv_size, config.hidden_size)
    per_token = (6 * config.hidden_size + 4 * width) * max(itemsize, 4)
    attention = 4 * (seqs + 128) * 128 * config.num_heads * config.head_dim * 4
    logits = 6 * seqs * config.vocab_size * 4
    return tokens * per_token + attention + logits


def decide_num_blocks(
    config: ModelConfig,
    *,
    bytes_per_block: int,
    block_size: int,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    itemsize: int,
    num_blocks: int | None = None,
    kv_cache_memory: int | None = None,
    memory_utilization: float = 0.9,
    device: Any = None,
) -> KVCacheDecision:
    """The pool size for this model and configuration (see the module docstring)."""
    if not 0.0 < memory_utilization <= 1.0:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {memory_utilization}")
    per_seq = math.ceil(max_model_len / block_size)
    wanted = max_num_seqs * per_seq
    # The device pool holds one scratch block past the managed ones.
    if num_blocks is not None:
        decision = KVCacheDecision(num_blocks, bytes_per_block, block_size, "num_gpu_blocks")
    elif kv_cache_memory is not None:
        blocks = kv_cache_memory // bytes_per_block - 1
        decision = KVCacheDecision(
            max(blocks, 0),
            bytes_per_block,
            block_size,
            f"kv_cache_memory={kv_cache_memory / GIB:.2f} GiB",
        )
    else:
        device = device or jax.local_devices()[0]
        on_cpu = getattr(device, "platform", "cpu") == "cpu"
        stats = None if on_cpu else device.memory_stats()
        if stats and "bytes_limit" in stats:
            activations = step_activation_bytes(
                config, max_num_batched_tokens, max_num_seqs, itemsize
            )
            budget = int(stats["bytes_limit"] * memory_utilization)
            free = budget - int(stats.get("bytes_in_use", 0)) - activations
            decision = KVCacheDecision(
                max(free // bytes_per_block - 1, 0),
                bytes_per_block,
                block_size,
                f"{memory_utilization:.0%} of {stats['bytes_limit'] / GIB:.1f} GiB device "
                f"memory, after {int(stats.get('bytes_in_use', 0)) / GIB:.2f} GiB in use and "
                f"{activations / GIB:.2f} GiB reserved for step activations",
            )
        else:
            budget, where = cpu_kv_budget(host_total_bytes(), host_available_bytes())
            cap = wanted if budget is None else budget // bytes_per_block - 1
            blocks = min(wanted, cap)
            reason = (
                f"max_num_seqs={max_num_seqs} x max_model_len={max_model_len}"
                if blocks == wanted
                else where
            )
            decision = KVCacheDecision(max(blocks, 0), bytes_per_block, block_size, reason)
    if decision.num_blocks < per_seq:
        raise ValueError(
            f"the KV cache cannot hold one max_model_len={max_model_len} sequence: it needs "
            f"{per_seq} blocks ({per_seq * bytes_per_block / GIB:.2f} GiB) but gets "
            f"{decision.num_blocks} ({decision.reason}); lower max_model_len or give the "
            "cache more memory (kv_cache_memory / --kv-cache-memory, num_gpu_blocks, "
            "gpu_memory_utilization)"
        )
    logger.info(decision.describe())
    return decision


def size_kv_cache(
    config: ModelConfig,
    params: Params,
    kv_cache_dtype: str | None,
    block_size: int,
    tensor_parallel_size: int,
    device: jax.Device,
    *,
    num_blocks: int | None,
    max_model_len: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    kv_cache_memory: int | None,
    memory_utilization: float,
) -> tuple[KVCacheSpec, KVCacheDecision]:
    """The whole cache's spec for placed ``params``: the pools' dtype
    (:func:`resolve_kv_cache_dtype`) and :func:`decide_num_blocks`'s block count, with
    the decision that led to it."""
    tp = tensor_parallel_size
    kv_dtype = resolve_kv_cache_dtype(kv_cache_dtype, params, device.platform)
    unit = KVCacheSpec.for_model(config, block_size, 1, kv_dtype, tp)
    decision = decide_num_blocks(
        config,
        bytes_per_block=unit.bytes_per_block // tp,  # this device's share of the heads
        block_size=block_size,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        itemsize=jnp.dtype(params["embed_tokens"]["weight"].dtype).itemsize,
        num_blocks=num_blocks,
        kv_cache_memory=kv_cache_memory,
        memory_utilization=memory_utilization,
        device=device,
    )
    spec = KVCacheSpec.for_model(config, block_size, decision.num_blocks, kv_dtype, tp)
    return spec, decision
