"""Which weights of a loaded params tree are packed into tiles for the CPU kernels.

Owns :func:`pack_weights`: the decoder layers' q/k/v/o and MLP projections, routed
experts, and an untied ``lm_head``, in the formats and shapes the core packs
(:func:`kvpage.quant.tiles.can_pack`). An embedding table keeps GGUF's row order (its
rows are looked up), and so does an ``lm_head`` tied to it. The engine calls it for a
model it loaded itself on one CPU device (``engine/loading.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from kvpage.quant.tiles import can_pack, pack_tiles
from kvpage.quant.weights import QuantizedWeight

_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _packed(w: Any) -> QuantizedWeight | None:
    """``w`` packed, or None where it stays as it is."""
    if (not isinstance(w, QuantizedWeight) or w.layout != "rows"
            or not can_pack(w.kind, w.shape[-2])):
        return None
    # device_put, not jnp.asarray: that compiles a copy for every shape (4 compiles a
    # start for SmolLM2).
    blocks = jax.device_put(pack_tiles(w.kind, np.asarray(w.blocks)))
    return QuantizedWeight(blocks, w.kind, w.shape, w.dtype, w.row_scales, layout="tiles16")


def pack_weights(params: dict[str, Any],
                 experts_read_packed: Callable[[dict[str, Any]], bool] = lambda mlp: True) -> int:
    """Pack, in place, the decoder layers' projection weights, the experts of each MoE
    layer whose ``mlp`` ``experts_read_packed`` accepts (the one MoE host call reads them
    packed; any other path would unpack them every step), and an untied ``lm_head``, where
    :func:`can_pack`; returns how many were packed."""
    nodes: list[dict[str, Any]] = []
    for layer in params.get("layers", []):
        for part in ("self_attn", "mlp"):
            block = layer.get(part, {}) if isinstance(layer, dict) else {}
            nodes += [block.get(name) for name in _PROJECTIONS]
            experts = block.get("experts") if isinstance(block, dict) else None
            if isinstance(experts, dict) and experts_read_packed(block):
                nodes += [experts.get(n) for n in ("gate_proj", "up_proj", "down_proj")]
    embedding = params.get("embed_tokens", {}).get("weight")
    lm_head = params.get("lm_head")
    if isinstance(lm_head, dict) and lm_head.get("weight") is not embedding:
        nodes.append(lm_head)
    count = 0
    for node in nodes:
        if isinstance(node, dict) and (packed := _packed(node.get("weight"))) is not None:
            node["weight"] = packed
            count += 1
    return count
