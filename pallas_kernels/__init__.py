"""Paged-attention kernels for kvpage.

The contract every backend implements is written once, in ``reference.py``:
queries of many sequences concatenated along the token axis (``cu_q_lens``),
each attending causally to its own paged KV (``kv_lens``, ``block_tables``).
"""

from pallas_kernels.reference import (
    ragged_paged_attention_reference,
    write_kv_pages,
)

__all__ = ["ragged_paged_attention_reference", "write_kv_pages"]
