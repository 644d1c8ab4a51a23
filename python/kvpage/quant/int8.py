"""Per-channel int8 weight-only quantization of a float checkpoint, at load time.

Owns :func:`quantize_int8`: each output row ``w[o]`` becomes ``q[o] = round(w[o] / s[o])``
with ``s[o] = max|w[o]| / 127`` (a zero row keeps ``s = 0``), on the host, so the float
weight never needs a second device copy. The product reads ``q`` and scales each output
by ``s`` (``rust/kernels/quant``).
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from kvpage.quant.weights import QuantizedWeight


def quantize_int8(weight: Any, dtype: Any = jnp.float32) -> QuantizedWeight:
    """A float ``[out, in]`` weight as per-channel int8 (host numpy arrays)."""
    w = np.asarray(weight, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"int8 quantization takes [out, in] weights, got shape {w.shape}")
    scale = np.abs(w).max(axis=1) / np.float32(127.0)
    inverse = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)
    q = np.clip(np.rint(w * inverse[:, None]), -127, 127).astype(np.int8)
    return QuantizedWeight(q, "int8", w.shape, dtype, row_scales=scale.astype(np.float32))
