"""Weight-only quantization: linear weights kept in their quantized blocks.

* :mod:`kvpage.quant.formats`: the formats' names and block layouts, from the table that
  owns them (``rust/kernels/quant/formats.rs``, through ``kvpage._core.quant_formats()``).
* :mod:`kvpage.quant.weights`: :class:`QuantizedWeight`, the pytree node a quantized
  ``[out, in]`` weight is in the params tree, and its float view.
* :mod:`kvpage.quant.gguf_blocks`: GGUF's block formats (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q6_K)
  dequantized in JAX, bit-exact with the ``gguf`` package's reference.
* :mod:`kvpage.quant.int8`: per-channel int8 of a float checkpoint, at load time.
* :mod:`kvpage.quant.modes`: the ``--quantization`` modes and what each keeps quantized.
* :mod:`kvpage.quant.tiles`: Q4_0 / Q4_1 blocks packed into tiles of sixteen rows for the
  CPU kernels; :mod:`kvpage.quant.packing`: which weights of a loaded model are.

The products run in the Rust core on CPU (``python/kvpage/kernels/host/cpu_qmatmul.py``), reading
the blocks as stored; elsewhere, and under a device mesh, the model dequantizes a
weight inside the step (:func:`kvpage.model.linear_kernels.matmul_nt`).
"""

from kvpage.quant.modes import QUANTIZATION_MODES
from kvpage.quant.weights import QuantizedWeight, is_quantized

__all__ = ["QUANTIZATION_MODES", "QuantizedWeight", "is_quantized"]
