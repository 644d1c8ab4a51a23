"""Which decoder layers of a decode step run as one host custom call, and that call.

Owns :func:`max_rows` (the policy) and :func:`decode_layer` (the traced call). On the
host CPU a decode step's layer runs as ``pallas_kernels/cpu_decode_layer.py``'s single
custom call instead of ~30 XLA ops when it is turned on (``KVPAGE_CPU_DECODE_LAYER=1``;
off by default: it measured no faster, see ``pallas_kernels/cpu_decode_layer.py``) and
every piece of it has a host kernel:

* the model is a plain Llama-family decoder: no q/k norms, no biases, float32 norms and
  activations, a float32 KV pool;
* every linear weight is a :class:`~kvpage.quant.QuantizedWeight` whose format the core
  reads (up to ``DEQUANTIZE_ROWS - 1`` rows, where quantized products stay in the
  kernel), or a float32 ``[out, in]`` array (up to the host float kernel's row limit,
  ``pallas_kernels.cpu_matmul.max_rows()``; a trainer's transposed kernel does not
  qualify);
* every row has exactly one new token (the caller's ``decode_only`` promise).

The model runner asks :func:`max_rows` once per model to know which decode buckets get a
variant of their own (``kvpage/runner/model_runner.py``); the traced decoder layer asks
:func:`applies` and lowers the call in the ``cpu`` branch of ``lax.platform_dependent``,
so the same trace still lowers for other platforms.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from kvpage.model.config import ModelConfig
from kvpage.quant.weights import QuantizedWeight
from pallas_kernels import cpu_decode_layer, cpu_matmul, cpu_qmatmul

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def _weights(layer: dict[str, Any]) -> list[Any] | None:
    try:
        linears = [layer["self_attn"][n] for n in _ATTENTION] + [layer["mlp"][n] for n in _MLP]
    except (KeyError, TypeError):
        return None
    if any(not isinstance(linear, dict) or set(linear) != {"weight"} for linear in linears):
        return None  # biases, or another layout
    return [linear["weight"] for linear in linears]


def _weight_rows(weight: Any) -> int:
    """The most rows a product with ``weight`` may have inside the call (0: none)."""
    if isinstance(weight, QuantizedWeight):
        ok = cpu_qmatmul.available(weight.kind)
        return cpu_qmatmul.DEQUANTIZE_ROWS - 1 if ok else 0
    if isinstance(weight, jax.Array | jax.ShapeDtypeStruct) and weight.ndim == 2:
        return cpu_matmul.max_rows() if weight.dtype == jnp.float32 else 0
    return 0


def max_rows(config: ModelConfig, layer: dict[str, Any], kv_dtype: Any) -> int:
    """The most decode rows a layer of this model runs as one host call (0: never)."""
    weights = _weights(layer)
    if (
        weights is None
        or config.qk_norm
        or jnp.dtype(kv_dtype) != jnp.float32
        or not cpu_decode_layer.enabled()
    ):
        return 0
    norms = (layer["input_layernorm"]["weight"], layer["post_attention_layernorm"]["weight"])
    if any(jnp.dtype(n.dtype) != jnp.float32 for n in norms):
        return 0
    return min(_weight_rows(w) for w in weights)


def applies(
    config: ModelConfig, layer: dict[str, Any], hidden: jax.Array, pool: Any, meta: Any
) -> bool:
    """Whether a decode step of ``hidden``'s rows runs this layer as one host call (one
    token per sequence row: as many token rows as sequence rows)."""
    rows = hidden.shape[0]
    return (
        hidden.dtype == jnp.float32
        and meta.kv_lens.shape[0] == rows
        and meta.block_tables.shape[0] == rows
        and meta.slot_mapping.shape[0] == rows
        and rows <= max_rows(config, layer, pool[0].dtype)
    )


def decode_layer(
    config: ModelConfig,
    layer: dict[str, Any],
    hidden: jax.Array,
    cos: jax.Array,
    sin: jax.Array,
    pool: tuple[jax.Array, jax.Array],
    meta: Any,
    otherwise: Callable[[], tuple[jax.Array, tuple[jax.Array, jax.Array]]],
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """``(hidden, pool)`` after the layer: the host call when lowered for CPU,
    ``otherwise()`` (the traced layer) on any other platform."""
    weights = _weights(layer)
    assert weights is not None, "decode_layer called where applies() is False"

    def on_cpu() -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        out, k_pages, v_pages = cpu_decode_layer.decode_layer_call(
            hidden,
            cos,
            sin,
            meta.slot_mapping,
            meta.kv_lens,
            meta.block_tables,
            pool[0],
            pool[1],
            layer["input_layernorm"]["weight"],
            layer["post_attention_layernorm"]["weight"],
            weights,
            rms_norm_eps=config.rms_norm_eps,
            sm_scale=config.head_dim**-0.5,
        )
        return out.astype(hidden.dtype), (k_pages, v_pages)

    return lax.platform_dependent(cpu=on_cpu, default=otherwise)
