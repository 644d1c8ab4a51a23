"""The dense gated MLP (SwiGLU or GeGLU) and the activations of every architecture.

Owns :func:`gated_mlp` -- ``down(act(gate(x)) * up(x))`` -- and :func:`activation_fn`
(``"silu"``; ``"gelu_tanh"``, the tanh approximation of GELU that transformers calls
``gelu_pytorch_tanh``). The experts of :mod:`kvpage.model.moe` use the same activations.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

from kvpage.model.linear import linear, linears

_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu": jax.nn.silu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
}


def activation_fn(name: str) -> Callable[[jax.Array], jax.Array]:
    return _ACTIVATIONS[name]


def gated_mlp(mlp: dict[str, Any], x: jax.Array, hidden_act: str = "silu") -> jax.Array:
    """``down_proj(act(gate_proj(x)) * up_proj(x))``."""
    act = _ACTIVATIONS[hidden_act]
    gate, up = linears(x, [mlp["gate_proj"], mlp["up_proj"]])
    return linear(act(gate) * up, mlp["down_proj"])
