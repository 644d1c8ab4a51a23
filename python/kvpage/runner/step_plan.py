"""The step plan: the int32 arrays one scheduler step hands to the model runner.

This file owns the plan's contract. The Rust core produces an object with these
attributes (any object with them works -- the runner only duck-types); :class:`StepPlan`
is a plain Python implementation for tests, tools and Python-side schedulers.

Arrays arrive unpadded (exactly T tokens, S sequences, S' sampled rows, C copies); the
runner pads them to its buckets.

=================  ==================  ==============================================
field              shape               meaning
=================  ==================  ==============================================
token_ids          [T] int32           new tokens, flattened over sequences
positions          [T] int32           absolute position of each token in its sequence
slot_mapping       [T] int32           ``block * block_size + offset`` for the token's K/V
cu_q_lens          [S + 1] int32       sequence s owns tokens ``cu_q_lens[s]:cu_q_lens[s+1]``
kv_lens            [S] int32           KV length of each sequence after this step
block_tables       [S, max_blocks]     physical block of each logical block; unused
                                       entries hold the scratch block id ``num_blocks``
logits_indices     [S'] int32          flat token positions whose logits are sampled
sample_rows        [S'] int32          request slot whose sampling state applies to the row
copy_src/copy_dst  [C] int32           whole-block copy-on-write copies, run before the step
num_seqs           int                 S
num_tokens         int                 T
token_bitmask      [S', W] int32       optional: allowed tokens of each sampled row (structured
                                       outputs; W = ceil(vocab / 32), see
                                       :mod:`kvpage.runner.token_bitmask`); None allows all
=================  ==================  ==============================================
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


class StepPlanLike(Protocol):
    token_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    cu_q_lens: np.ndarray
    kv_lens: np.ndarray
    block_tables: np.ndarray
    logits_indices: np.ndarray
    sample_rows: np.ndarray
    copy_src: np.ndarray
    copy_dst: np.ndarray
    num_seqs: int
    num_tokens: int


def _empty() -> np.ndarray:
    return np.zeros(0, np.int32)


@dataclass(slots=True)
class StepPlan:
    """A step plan built in Python (see the module docstring for the fields)."""

    token_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    cu_q_lens: np.ndarray
    kv_lens: np.ndarray
    block_tables: np.ndarray
    logits_indices: np.ndarray
    sample_rows: np.ndarray
    copy_src: np.ndarray = field(default_factory=_empty)
    copy_dst: np.ndarray = field(default_factory=_empty)
    num_seqs: int = -1
    num_tokens: int = -1
    token_bitmask: np.ndarray | None = None

    def __post_init__(self) -> None:
        if self.num_seqs < 0:
            self.num_seqs = len(self.kv_lens)
        if self.num_tokens < 0:
            self.num_tokens = len(self.token_ids)
