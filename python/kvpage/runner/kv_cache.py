"""The paged KV cache on device: sizing and allocation of the per-layer pools.

This file owns the pools' shape and memory accounting. Each layer has a K pool and a V
pool of shape ``[num_kv_heads, num_blocks + 1, block_size, head_dim]``; blocks
``0 .. num_blocks - 1`` are managed by the Rust block pool and block ``num_blocks`` is a
scratch block that padded tokens write to (never read). With tensor parallelism the pools
are split along the KV-head axis, so each device holds ``1 / tensor_parallel_size``.
"""

from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvpage.model.config import ModelConfig
from kvpage.model.params import Params, jnp_dtype
from kvpage.quant.weights import is_quantized

KVPools = list[tuple[jax.Array, jax.Array]]


def resolve_kv_cache_dtype(requested: str | None, params: Params, platform: str) -> str:
    """The pools' dtype for ``requested`` (an EngineConfig ``kv_cache_dtype``).

    ``"auto"`` (or None) is float16 when the decoder layers hold quantized weights on
    CPU, as llama.cpp keeps its cache: the host attention kernel widens f16 in registers,
    so a decode step reads half the K/V bytes (``cargo bench --bench cpu_attention``,
    ``*_f16``) and the same memory holds twice the tokens. Otherwise it is the weights'
    dtype, so float checkpoints keep their exact parity with transformers."""
    weights = str(jnp.dtype(params["embed_tokens"]["weight"].dtype))
    if requested not in (None, "auto"):
        return requested
    leaves = jax.tree_util.tree_leaves(params["layers"], is_leaf=is_quantized)
    quantized = any(map(is_quantized, leaves))
    if platform == "cpu" and weights == "float32" and quantized:
        return "float16"
    return weights


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Shape and dtype of the whole paged cache."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    num_blocks: int
    dtype: str
    tensor_parallel_size: int = 1

    @classmethod
    def for_model(
        cls,
        config: ModelConfig,
        block_size: int,
        num_blocks: int,
        dtype: str | None = None,
        tensor_parallel_size: int = 1,
    ) -> KVCacheSpec:
        if block_size <= 0 or num_blocks <= 0:
            raise ValueError(
                f"block_size and num_blocks must be positive, got {block_size}, {num_blocks}"
            )
        return cls(
            config.num_layers,
            config.num_kv_heads,
            config.head_dim,
            block_size,
            num_blocks,
            dtype or config.dtype,
            tensor_parallel_size,
        )

    @property
    def pool_shape(self) -> tuple[int, int, int, int]:
        """One layer's K (or V) pool, scratch block included."""
        return (self.num_kv_heads, self.num_blocks + 1, self.block_size, self.head_dim)

    @property
    def scratch_block(self) -> int:
        return self.num_blocks

    @property
    def scratch_slot(self) -> int:
        """Slot-mapping value for padded tokens (first slot of the scratch block)."""
        return self.num_blocks * self.block_size

    @property
    def bytes_per_block(self) -> int:
        """Device bytes one block costs, over all layers, K and V."""
        itemsize = np.dtype(jnp_dtype(self.dtype)).itemsize
        return 2 * self.num_layers * self.num_kv_heads * self.block_size * self.head_dim * itemsize

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_block * (self.num_blocks + 1)

    @property
    def bytes_per_device(self) -> int:
        """Device bytes of the whole cache on each device (its share of the KV heads)."""
        return self.total_bytes // self.tensor_parallel_size


def allocate_kv_cache(
    spec: KVCacheSpec, device: jax.Device | jax.sharding.Sharding | None = None
) -> KVPools:
    """Zero-filled ``(k_pages, v_pages)`` for every layer, on ``device`` (a device, or a
    sharding such as the KV-head split of tensor parallelism).

    On one CPU device the pools come from the host kernel ``kvpage_zeros``
    (``rust/kernels/lazy_zeros.rs``): XLA allocates each pool and its pages are released
    rather than written, so a pool is ready at once and holds memory only where blocks
    are written (SmolLM2's 4 GiB default pool took 2.4-7.8 s to zero-fill and stayed
    resident; benches/RESULTS.md, "First minute"). Elsewhere they are filled from
    several threads: a CPU fill is bound by first-touch page faults, which run in
    parallel (SmolLM2's 4 GiB pool on 2 cores: 6.3 s from one thread, 2.4 s from two)."""
    dtype = jnp_dtype(spec.dtype)
    lazy = _lazy_zeros(spec.pool_shape, dtype, device)
    if lazy is not None:
        pages = [lazy() for _ in range(2 * spec.num_layers)]
        jax.block_until_ready(pages)
        return [(pages[2 * i], pages[2 * i + 1]) for i in range(spec.num_layers)]

    def zeros(_: int) -> jax.Array:
        return jax.block_until_ready(jnp.zeros(spec.pool_shape, dtype, device=device))

    # The first pool is made here, so the fill's executable is compiled once: threads
    # that miss JAX's in-memory cache together each compile it (a second start then
    # loaded one executable fewer than the first compiled).
    pages = [zeros(0)]
    workers = max(1, min(4, os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        pages += pool.map(zeros, range(1, 2 * spec.num_layers))
    return [(pages[2 * i], pages[2 * i + 1]) for i in range(spec.num_layers)]


def _lazy_zeros(
    shape: tuple[int, ...], dtype: Any, device: jax.Device | jax.sharding.Sharding | None
) -> Callable[[], jax.Array] | None:
    """A function making one zero pool with ``kvpage_zeros`` on ``device``, or None where
    it does not apply (not one CPU device, or a core without the handler)."""
    if isinstance(device, jax.sharding.Sharding):
        if len(device.device_set) != 1:
            return None
        (device,) = device.device_set
    device = device or jax.devices()[0]
    if device.platform != "cpu" or os.environ.get("KVPAGE_LAZY_KV_ZEROS", "1") == "0":
        return None
    from kvpage.kernels.host._host_ffi import register

    if not register(LAZY_ZEROS_TARGET):
        return None
    call = jax.ffi.ffi_call(LAZY_ZEROS_TARGET, jax.ShapeDtypeStruct(shape, dtype))
    return jax.jit(call, out_shardings=jax.sharding.SingleDeviceSharding(device))


LAZY_ZEROS_TARGET = "kvpage_zeros"


def copy_blocks(pools: KVPools, src: jax.Array, dst: jax.Array) -> KVPools:
    """Copy whole blocks ``src[i] -> dst[i]`` in every layer's K and V pool.

    Out-of-range ``dst`` entries (e.g. ``num_blocks + 1``) are dropped, which is how
    padded copy entries are expressed.
    """
    return [
        (
            k.at[:, dst].set(k[:, src], mode="drop"),
            v.at[:, dst].set(v[:, src], mode="drop"),
        )
        for k, v in pools
    ]


def pool_bytes_on(pools: KVPools, device: jax.Device) -> int:
    """Bytes of ``pools`` (all layers, K and V) held on ``device``."""
    return sum(
        shard.data.nbytes
        for pool in pools
        for pages in pool
        for shard in pages.addressable_shards
        if shard.device == device
    )
