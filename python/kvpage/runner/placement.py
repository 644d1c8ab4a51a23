"""Where a runner's arrays live: one device, or a tensor-parallel mesh.

This file owns :class:`Placement`: the shardings of the params (Megatron-style over the
``"tp"`` axis, :mod:`kvpage.runner.tensor_parallel`), of the KV pools (split by KV head)
and of everything else (replicated), and the helpers every executable builder and step
uses with them: abstract shapes for lowering, host inputs, per-shard block copies and the
replicated logits.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

from kvpage.model.config import ModelConfig
from kvpage.model.decoder import compute_logits
from kvpage.model.params import Params
from kvpage.runner.kv_cache import KVPools, copy_blocks
from kvpage.runner.tensor_parallel import TP_AXIS, mesh_size, param_shardings


class Placement:
    """The shardings of one runner's arrays on ``device`` or over ``mesh``."""

    def __init__(
        self, config: ModelConfig, params: Params, mesh: Mesh | None, device: jax.Device
    ) -> None:
        self.config = config
        self.mesh = mesh
        self.device = device
        self.tensor_parallel_size = mesh_size(mesh) if mesh is not None else 1
        self.replicated: jax.sharding.Sharding
        self.pool_sharding: jax.sharding.Sharding
        self.param_shardings: Any
        if mesh is not None:
            self.replicated = NamedSharding(mesh, PartitionSpec())
            self.pool_sharding = NamedSharding(mesh, PartitionSpec(TP_AXIS))
            self.param_shardings = param_shardings(config, params, mesh)
        else:
            self.replicated = self.pool_sharding = SingleDeviceSharding(device)
            self.param_shardings = jax.tree_util.tree_map(lambda _: self.replicated, params)
        self.multiprocess = mesh is not None and not all(
            d.process_index == jax.process_index() for d in mesh.devices.flat
        )
        """The mesh spans several processes (host inputs become global arrays)."""

    def copy_blocks(self, pools: KVPools, src: jax.Array, dst: jax.Array) -> KVPools:
        """:func:`copy_blocks`, per KV-head shard when the pools are sharded."""
        if self.mesh is None:
            return copy_blocks(pools, src, dst)
        pages = jax.tree_util.tree_map(lambda _: PartitionSpec(TP_AXIS), pools)
        mapped = jax.shard_map(
            copy_blocks,
            mesh=self.mesh,
            in_specs=(pages, PartitionSpec(), PartitionSpec()),
            out_specs=pages,
            check_vma=False,
        )
        return mapped(pools, src, dst)

    def shardings(self, tree: Any, sharding: jax.sharding.Sharding | None = None) -> Any:
        """``sharding`` (default: replicated) for every leaf of ``tree``."""
        target = sharding or self.replicated
        return jax.tree_util.tree_map(lambda _: target, tree)

    def abstract(self, tree: Any, sharding: Any = None) -> Any:
        """``tree``'s leaves as ShapeDtypeStructs (lowering never touches live buffers,
        which the engine thread may be donating meanwhile). ``sharding``: one sharding
        for every leaf, or None to keep each leaf's own."""
        return jax.tree_util.tree_map(
            lambda x: jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=sharding if sharding is not None else x.sharding
            ),
            tree,
        )

    def logits_of(self) -> Callable[[Params, jax.Array], jax.Array]:
        """Final norm + lm_head; with a mesh, each device projects its vocab rows and the
        logits are then replicated (every device samples the same full rows)."""
        config = self.config
        if self.mesh is None:
            return lambda head, rows: compute_logits(head, config, rows)
        replicated = self.replicated
        vocab_split = None
        if config.vocab_size % self.tensor_parallel_size == 0:
            vocab_split = NamedSharding(self.mesh, PartitionSpec(None, TP_AXIS))

        def logits_of(head: Params, rows: jax.Array) -> jax.Array:
            logits = compute_logits(head, config, rows)
            if vocab_split is not None:
                logits = jax.lax.with_sharding_constraint(logits, vocab_split)
            return jax.lax.with_sharding_constraint(logits, replicated)

        return logits_of

    def host_input(self, value: np.ndarray) -> Any:
        """A host array as a step input: as is on one process; with a mesh spanning
        several processes, a replicated global array (every process passes the same)."""
        if not self.multiprocess:
            return value
        return jax.make_array_from_process_local_data(self.replicated, value, value.shape)
