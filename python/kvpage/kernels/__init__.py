"""kvpage's kernels: what a step calls below the model code.

* ``pallas/``: Pallas kernels (GPU; interpret mode on CPU).
* ``xla/``: paged attention in plain XLA ops, and the reference implementation.
* ``host/``: JAX wrappers of the Rust core's host CPU kernels (XLA FFI custom calls).
* ``dispatch.py``: :func:`paged_attention`, which picks the attention backend.

Dependencies point down only: to JAX and to ``kvpage._core`` (the compiled Rust
kernels); nothing here imports the engine, runner or model.

The attention contract every backend implements is written once, in ``xla/reference.py``:
queries of many sequences concatenated along the token axis (``cu_q_lens``),
each attending causally to its own paged KV (``kv_lens``, ``block_tables``), with an
optional sliding window, logit soft-cap and attention sinks.

* ``pallas/ragged_paged_attention.py``: the general Pallas kernel (prefill + decode).
* ``pallas/paged_decode_attention.py``: split-K Pallas kernel for pure-decode steps.
* ``xla/xla_paged_attention.py``: flash attention in plain XLA, work and scratch
  following the live KV lengths (the default off-GPU).
"""

from kvpage.kernels.dispatch import BACKENDS, paged_attention, resolve_backend
from kvpage.kernels.pallas.paged_decode_attention import paged_decode_attention
from kvpage.kernels.pallas.ragged_paged_attention import ragged_paged_attention
from kvpage.kernels.xla.reference import (
    ragged_paged_attention_reference,
    write_kv_pages,
)
from kvpage.kernels.xla.xla_paged_attention import xla_paged_attention

__all__ = [
    "BACKENDS",
    "paged_attention",
    "paged_decode_attention",
    "ragged_paged_attention",
    "ragged_paged_attention_reference",
    "resolve_backend",
    "write_kv_pages",
    "xla_paged_attention",
]
