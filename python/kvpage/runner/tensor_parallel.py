"""Tensor parallelism: the device mesh, the params' shardings and the per-shard attention.

This file owns how one model is split over ``tensor_parallel_size`` devices
(Megatron-style, over a 1-D :class:`jax.sharding.Mesh` with the axis ``"tp"``):

* **Params** (:func:`param_partition_specs`): ``q_proj``/``k_proj``/``v_proj``,
  ``gate_proj``/``up_proj`` are split by output features (whole attention heads, MLP
  columns); ``o_proj``/``down_proj`` by input features (rows), so each layer needs one
  all-reduce after attention and one after the MLP, which XLA's SPMD partitioner
  inserts. Mixture-of-experts weights ``[E, out, in]`` are split the same way within
  every expert (not expert-parallel): each device holds a slice of every expert, so
  routing needs no token exchange and the one all-reduce after the MLP stays; the
  router is replicated. ``embed_tokens``/``lm_head`` are split by vocabulary row when the vocabulary
  divides evenly (else replicated); norms and row-parallel biases are replicated.
* **KV cache**: every layer's ``[num_kv_heads, blocks, block_size, head_dim]`` pool is
  split along the KV-head axis, so each device holds ``1 / tensor_parallel_size`` of it.
* **Attention** (:func:`shard_attention_backend`): the paged-attention kernel (Pallas or
  the reference) and the KV write run per shard under :func:`jax.shard_map` on the local
  query and KV heads; block tables, lengths and all other step arrays are replicated.

The runner (:class:`kvpage.runner.ModelRunner`) builds the mesh from
``tensor_parallel_size``; training code can lay its params out the same way with
:func:`shard_params` so that ``LLM.from_params`` / ``update_params`` adopt them without
a copy. With several hosts, call :func:`jax.distributed.initialize` first on every host:
:func:`make_mesh` then spans the global devices and every host runs the same engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, Sharding

from kvpage.model.attention import AttentionBackend
from kvpage.model.config import ModelConfig
from kvpage.model.params import Params
from kvpage.model.transposed_weight import TransposedWeight, is_transposed

TP_AXIS = "tp"

_COLUMN_PARALLEL = frozenset({"q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"})
_ROW_PARALLEL = frozenset({"o_proj", "down_proj"})
_VOCAB_PARALLEL = frozenset({"embed_tokens", "lm_head"})


def check_tensor_parallel(config: ModelConfig, tensor_parallel_size: int) -> None:
    """ValueError unless ``tensor_parallel_size`` divides the heads and the MLP width."""
    n = tensor_parallel_size
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"tensor_parallel_size must be a positive integer, got {n!r}")
    if config.num_kv_heads % n or config.num_heads % n:
        raise ValueError(
            f"tensor_parallel_size={n} must divide the model's number of attention heads: "
            f"num_heads={config.num_heads}, num_kv_heads={config.num_kv_heads}"
        )
    if config.intermediate_size % n:
        raise ValueError(
            f"tensor_parallel_size={n} must divide the model's intermediate_size="
            f"{config.intermediate_size}"
        )
    if config.moe is not None and (
        config.moe.intermediate_size % n or config.moe.shared_expert_intermediate_size % n
    ):
        raise ValueError(
            f"tensor_parallel_size={n} must divide the experts' width "
            f"{config.moe.intermediate_size} (and the shared expert's)"
        )


def make_mesh(tensor_parallel_size: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
    """A 1-D ``("tp",)`` mesh over the first ``tensor_parallel_size`` of ``devices``.

    ``devices`` defaults to :func:`jax.devices` -- every device of every process after
    :func:`jax.distributed.initialize`.
    """
    pool = list(jax.devices() if devices is None else devices)
    if tensor_parallel_size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {tensor_parallel_size}")
    if tensor_parallel_size > len(pool):
        hint = ""
        if pool and pool[0].platform == "cpu":
            hint = (
                "; on CPU, simulate devices with "
                f"XLA_FLAGS=--xla_force_host_platform_device_count={tensor_parallel_size}"
            )
        raise ValueError(
            f"tensor_parallel_size={tensor_parallel_size} needs that many devices, "
            f"but only {len(pool)} are visible{hint}"
        )
    return Mesh(np.asarray(pool[:tensor_parallel_size]), (TP_AXIS,))


def mesh_size(mesh: Mesh, axis: str = TP_AXIS) -> int:
    """The size of ``axis`` in ``mesh`` (ValueError if it has no such axis)."""
    if axis not in mesh.axis_names:
        raise ValueError(f"the mesh has no {axis!r} axis (axes: {mesh.axis_names})")
    return int(mesh.shape[axis])


def _leaf_spec(names: tuple[str, ...], ndim: int, vocab_split: bool, axis: str) -> PartitionSpec:
    """Spec of one unstacked leaf from its ``(..., module, "weight" | "bias")`` names."""
    module, kind = (names[-2], names[-1]) if len(names) >= 2 else ("", names[-1])
    if "experts" in names and ndim == 3:  # [E, out, in]: split within every expert
        if module in _COLUMN_PARALLEL:
            return PartitionSpec(None, axis, None)
        return PartitionSpec(None, None, axis)
    if module in _COLUMN_PARALLEL:
        return PartitionSpec(axis, None) if kind == "weight" else PartitionSpec(axis)
    if module in _ROW_PARALLEL and kind == "weight":
        return PartitionSpec(None, axis)
    if module in _VOCAB_PARALLEL and vocab_split:
        return PartitionSpec(axis, None)
    return PartitionSpec(*([None] * ndim))


def param_partition_specs(
    config: ModelConfig, params: Params, tensor_parallel_size: int, axis: str = TP_AXIS
) -> Any:
    """A pytree of :class:`PartitionSpec` shaped like ``params`` (list or stacked layers)."""
    vocab_split = tensor_parallel_size > 1 and config.vocab_size % tensor_parallel_size == 0
    layers = params.get("layers") if isinstance(params, Mapping) else None
    stacked = isinstance(layers, Mapping)

    def spec(path: tuple[Any, ...], leaf: Any) -> Any:
        names = tuple(str(k.key) for k in path if isinstance(k, jax.tree_util.DictKey))
        in_stack = stacked and names[:1] == ("layers",)
        if is_transposed(leaf):
            return _kernel_spec(names, leaf, vocab_split, axis)
        base = _leaf_spec(names, np.ndim(leaf) - int(in_stack), vocab_split, axis)
        return PartitionSpec(None, *base) if in_stack else base

    return jax.tree_util.tree_map_with_path(spec, params, is_leaf=is_transposed)


def _kernel_spec(
    names: tuple[str, ...], weight: TransposedWeight, vocab_split: bool, axis: str
) -> TransposedWeight:
    """The spec of a trainer-layout kernel ``[in..., out...]``, as a node of the same
    kind: the ``[out, in]`` rule of :func:`_leaf_spec` applied to the first output axis
    (column-parallel, vocab) or the first input axis (row-parallel); splitting a leading
    axis of a row-major merge is splitting the merged axis into equal runs."""
    dims: list[Any] = [None] * len(weight.kernel.shape)
    if weight.in_start or weight.index is not None:  # head-first views: replicated
        return weight.with_kernel(PartitionSpec(*dims))
    base = _leaf_spec(names, 2, vocab_split, axis)
    if base[0] == axis:  # output rows split
        dims[weight.in_axes] = axis
    elif base[1] == axis:  # input columns split
        dims[0] = axis
    return TransposedWeight(PartitionSpec(*dims), weight.in_axes)


def param_shardings(config: ModelConfig, params: Params, mesh: Mesh, axis: str = TP_AXIS) -> Any:
    """A pytree of :class:`NamedSharding` on ``mesh`` shaped like ``params``."""
    specs = param_partition_specs(config, params, mesh_size(mesh, axis), axis)
    return jax.tree_util.tree_map(
        lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, PartitionSpec)
    )


def place(tree: Any, shardings: Any) -> tuple[Any, int]:
    """Put every leaf of ``tree`` at its sharding; returns ``(placed tree, leaves moved)``.

    A leaf that is already a :class:`jax.Array` with an equivalent sharding is kept as
    the very same object (no copy, no transfer). Others are transferred with
    :func:`jax.device_put` (device to device when they live on devices already).
    """
    moved = 0

    def put(leaf: Any, sharding: Sharding) -> Any:
        nonlocal moved
        if isinstance(leaf, jax.Array) and leaf.sharding.is_equivalent_to(sharding, leaf.ndim):
            return leaf
        moved += 1
        return jax.device_put(leaf, sharding)

    placed = jax.tree_util.tree_map(put, tree, shardings)
    return placed, moved


def shard_params(config: ModelConfig, params: Params, mesh: Mesh) -> Params:
    """``params`` laid out as the engine shards them on ``mesh`` (see module docstring).

    Train with params placed like this (and keep them so, e.g. with
    ``jax.lax.with_sharding_constraint`` on the updated params) and
    ``LLM.update_params`` adopts each new step's arrays without copying.
    """
    check_tensor_parallel(config, mesh_size(mesh))
    placed, _ = place(params, param_shardings(config, params, mesh))
    return placed


def shard_attention_backend(
    backend: AttentionBackend, mesh: Mesh, axis: str = TP_AXIS
) -> AttentionBackend:
    """``backend`` run per shard: local query heads attend to local KV heads.

    Query head ``h`` reads KV head ``h // group``; with both head counts divisible by the
    mesh size, shard ``i`` holds query heads ``i * Hq / N ..`` and exactly the KV heads
    they read, so the kernel needs no communication.
    """
    heads = PartitionSpec(None, axis, None)  # q, k, v, out: [T, heads, D]
    pages = PartitionSpec(axis, None, None, None)  # pools: [Hkv, blocks, B, D]
    rep = PartitionSpec()

    def attend(
        q: jax.Array,
        k_pages: jax.Array,
        v_pages: jax.Array,
        kv_lens: jax.Array,
        block_tables: jax.Array,
        cu_q_lens: jax.Array,
        num_seqs: jax.Array,
        *,
        sm_scale: float,
        decode_only: bool = False,
        **options: Any,
    ) -> jax.Array:
        if options.get("sinks") is not None:
            raise ValueError("attention sinks are not supported with tensor parallelism")

        def local(*args: jax.Array) -> jax.Array:
            return backend.attend(*args, sm_scale=sm_scale, decode_only=decode_only,
                                  **options)

        mapped = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(heads, pages, pages, rep, rep, rep, rep),
            out_specs=heads,
            check_vma=False,
        )
        return mapped(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs)

    def write_kv(
        k_pages: jax.Array, v_pages: jax.Array, k: jax.Array, v: jax.Array, slots: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        mapped = jax.shard_map(
            backend.write_kv,
            mesh=mesh,
            in_specs=(pages, pages, heads, heads, rep),
            out_specs=(pages, pages),
            check_vma=False,
        )
        return mapped(k_pages, v_pages, k, v, slots)

    return AttentionBackend(backend.name, attend, write_kv, backend.decode_specialized)
