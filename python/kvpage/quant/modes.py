"""The ``--quantization`` modes: which weights stay quantized in memory.

* ``"auto"`` (default): a GGUF file's Q8_0 / Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q4_K / Q6_K tensors stay in
  their blocks when the model runs on CPU on one device (the Rust kernels read them);
  elsewhere they are dequantized at load (bfloat16 on accelerators), as with ``none``.
  A float checkpoint stays float.
* ``"none"``: dequantize everything at load (``--dtype`` picks the float type).
* ``"gguf"``: keep GGUF blocks on every platform (off CPU the step dequantizes each
  weight as it uses it).
* ``"int8"``: every linear weight (and a vocab projection) becomes per-channel int8 at
  load, from a float checkpoint or a GGUF file's values; embeddings are looked up from
  the same int8 rows.

Other GGUF types (Q5_0, Q5_1, Q2_K, Q3_K, Q5_K, float types) are always dequantized.
"""

from __future__ import annotations

from kvpage.quant import formats

QUANTIZATION_MODES: tuple[str, ...] = ("auto", "none", "gguf", "int8")
# GGUF tensor type names kept as blocks -> their kvpage format names (the formats table).
GGUF_KEPT: dict[str, str] = formats.GGUF_KEPT


def check_mode(mode: str) -> str:
    if mode not in QUANTIZATION_MODES:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATION_MODES)}, got {mode!r}"
        )
    return mode


def keeps_gguf_blocks(mode: str, platform: str, tensor_parallel_size: int = 1) -> bool:
    """Whether GGUF quantized tensors stay in their blocks under ``mode``."""
    check_mode(mode)
    if mode == "gguf":
        return True
    return mode == "auto" and platform == "cpu" and tensor_parallel_size == 1
