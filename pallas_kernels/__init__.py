"""Paged-attention kernels for kvpage.

The contract every backend implements is written once, in ``reference.py``:
queries of many sequences concatenated along the token axis (``cu_q_lens``),
each attending causally to its own paged KV (``kv_lens``, ``block_tables``).

* ``ragged_paged_attention.py``: the general Pallas kernel (prefill + decode).
* ``paged_decode_attention.py``: split-K Pallas kernel for pure-decode steps.
* ``xla_paged_attention.py``: flash attention in plain XLA, work and scratch
  following the live KV lengths (the default off-GPU).
* ``dispatch.py``: :func:`paged_attention`, which picks the backend.
"""

from pallas_kernels.dispatch import BACKENDS, paged_attention, resolve_backend
from pallas_kernels.paged_decode_attention import paged_decode_attention
from pallas_kernels.ragged_paged_attention import ragged_paged_attention
from pallas_kernels.reference import (
    ragged_paged_attention_reference,
    write_kv_pages,
)
from pallas_kernels.xla_paged_attention import xla_paged_attention

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
