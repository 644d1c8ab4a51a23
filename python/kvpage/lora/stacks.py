"""The runner's LoRA adapter stacks: where adapters live in the params tree, and which
adapter each token of a step uses.

Owns :class:`LoRAStacks`. With LoRA enabled, every adaptable projection of every layer
(:data:`~kvpage.lora.adapter.MODULES` present in the layer) gains two leaves beside its
``weight``: ``lora_a [slots, R, in]`` and ``lora_b [slots, out, R]`` (``slots =
max_loras + 1``, ``R = max_lora_rank``). Entry 0 is all zeros: rows without an adapter
use it. An adapter of rank ``r <= R`` sits in entry ``s`` zero-padded to ``R``, so the
layer's output for a row of slot ``s`` is exactly ``W x + B_s (A_s x)``
(:func:`kvpage.model.linear.linear`). The stacks are ordinary params leaves:
loading an adapter writes one entry of each (new arrays, swapped in by reference like any
weight update), and nothing recompiles.

Each step, :meth:`row_slots` maps the plan's rows (``row_request``: request handles) to
their slots; the packed step buffer spreads them over the rows' tokens
(:class:`~kvpage.runner.step_inputs.PackedLayout` with ``lora``).

Invariants: entry 0 stays zero; a slot's entries in every stack belong to one adapter
(written together by :meth:`write`); a request handle maps to a slot only while its
adapter is written there (the engine's :mod:`~kvpage.lora.slots` pins it).
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from kvpage.lora.adapter import MODULES, LoRAAdapter
from kvpage.model.params import Params

Key = tuple[int, str, str]
"""An adaptable projection: (layer, block, module)."""


def _adaptable(layers: list[dict[str, Any]]) -> Iterator[tuple[Key, dict[str, Any]]]:
    """Every adaptable projection node (one with a ``weight``) of ``layers``."""
    for i, layer in enumerate(layers):
        for block in ("self_attn", "mlp"):
            for module in MODULES:
                node = layer.get(block, {}).get(module)
                if isinstance(node, dict) and "weight" in node:
                    yield (i, block, module), node


def _replaced(params: Params, nodes: dict[Key, dict[str, Any]]) -> Params:
    """``params`` with those projection nodes replaced (the layers copied shallowly: the
    caller's tree is never changed)."""
    layers = [{k: dict(v) if isinstance(v, dict) else v for k, v in layer.items()}
              for layer in params["layers"]]
    for (i, block, module), node in nodes.items():
        layers[i][block][module] = node
    return {**params, "layers": layers}


class LoRAStacks:
    """Adapter stacks of ``max_loras`` slots of rank up to ``max_lora_rank``."""

    def __init__(self, max_loras: int, max_lora_rank: int) -> None:
        if max_loras < 1:
            raise ValueError(f"max_loras must be >= 1; got {max_loras}")
        if max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1; got {max_lora_rank}")
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.slot_of_request: dict[int, int] = {}
        """Request handle -> slot, for requests running under an adapter."""

    @staticmethod
    def _layers(params: Params) -> list[dict[str, Any]]:
        layers = params["layers"]
        if not isinstance(layers, list | tuple):
            raise ValueError("LoRA needs the per-layer params layout (a list of layers), "
                             "not the stacked one")
        return list(layers)

    def shapes(self, params: Params) -> dict[tuple[int, str], tuple[int, int]]:
        """``(layer, module) -> (out, in)`` of every adaptable projection."""
        return {(i, module): tuple(int(d) for d in node["weight"].shape)
                for (i, _, module), node in _adaptable(self._layers(params))}

    def attach(self, params: Params, dtype: Any, like: Params | None = None) -> Params:
        """``params`` with stacks beside each adaptable weight: ``like``'s (a params tree
        that has them: a weight update keeps the resident adapters), else zeros."""
        slots, rank = self.max_loras + 1, self.max_lora_rank
        old = dict(_adaptable(self._layers(like))) if like is not None else None
        nodes = {}
        for key, node in _adaptable(self._layers(params)):
            if old is not None:
                stacks = {"lora_a": old[key]["lora_a"], "lora_b": old[key]["lora_b"]}
            else:
                out, inner = (int(d) for d in node["weight"].shape)
                stacks = {"lora_a": jnp.zeros((slots, rank, inner), dtype),
                          "lora_b": jnp.zeros((slots, out, rank), dtype)}
            nodes[key] = {**node, **stacks}
        return _replaced(params, nodes)

    def detach(self, params: Params) -> Params:
        """``params`` without the stacks (the base model's tree)."""
        return _replaced(params, {
            key: {k: v for k, v in node.items() if k not in ("lora_a", "lora_b")}
            for key, node in _adaptable(self._layers(params)) if "lora_a" in node
        })

    def write(self, params: Params, slot: int, adapter: LoRAAdapter | None) -> Params:
        """``params`` with entry ``slot`` (1..max_loras) of every stack holding
        ``adapter`` (None: zeros). One device call updates every stack in place (the
        old stacks are donated: only the adapter's bytes are written), compiled once
        per adapter rank and set of modules."""
        if not 1 <= slot <= self.max_loras:
            raise ValueError(f"LoRA slot must be in 1..{self.max_loras}; got {slot}")
        nodes = {key: node for key, node in _adaptable(self._layers(params)) if "lora_a" in node}
        stacks = [(node["lora_a"], node["lora_b"]) for node in nodes.values()]
        entries = [None if adapter is None else adapter.weights.get((i, module))
                   for (i, _, module) in nodes]
        updated = _write_slot(stacks, jnp.int32(slot), entries)
        return _replaced(params, {
            key: {**node, "lora_a": a, "lora_b": b}
            for (key, node), (a, b) in zip(nodes.items(), updated, strict=True)
        })

    def row_slots(self, row_request: Any, num_rows: int) -> np.ndarray:
        """int32 ``[num_rows]``: the slot of each plan row's request (0: no adapter)."""
        get = self.slot_of_request.get
        if not self.slot_of_request:
            return np.zeros(num_rows, np.int32)
        return np.fromiter((get(int(h), 0) for h in row_request[:num_rows]), np.int32,
                           count=num_rows)


@functools.partial(jax.jit, donate_argnums=0)
def _write_slot(stacks: list[tuple[jax.Array, jax.Array]], slot: jax.Array,
                entries: list[tuple[Any, Any] | None]) -> list[tuple[jax.Array, jax.Array]]:
    """Entry ``slot`` of each ``(a [S, R, in], b [S, out, R])`` stack pair set to its
    ``(A [r, in], B [out, r])`` zero-padded to ``R`` (None: zeros)."""
    out = []
    for (a, b), pair in zip(stacks, entries, strict=True):
        new_a = jnp.zeros(a.shape[1:], a.dtype)
        new_b = jnp.zeros(b.shape[1:], b.dtype)
        if pair is not None:
            r = pair[0].shape[0]
            new_a = new_a.at[:r].set(jnp.asarray(pair[0], a.dtype))
            new_b = new_b.at[:, :r].set(jnp.asarray(pair[1], b.dtype))
        out.append((a.at[slot].set(new_a), b.at[slot].set(new_b)))
    return out


def stacks_dtype(params: Params) -> Any:
    """The float dtype the adapters compute in: the embeddings' (float32 for quantized
    models, whose activations are float32)."""
    weight = params["embed_tokens"]["weight"]
    dtype = jnp.dtype(getattr(weight, "dtype", jnp.float32))
    return dtype if jnp.issubdtype(dtype, jnp.floating) else jnp.float32



