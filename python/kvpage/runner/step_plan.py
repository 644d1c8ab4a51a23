"""The step plan: the int32 arrays one scheduler step hands to the model runner.

The contract is owned by ``rust/sched/step_plan.rs`` (the Rust core builds the plan the
engine passes straight to the runner); this is the runner's part of it, the fields
the runner reads. Any object with these attributes works (the runner only
duck-types); :class:`StepPlan` is a plain Python implementation for tests, tools and
Python-side schedulers.

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
sample_rows        [S'] int32          the row's seat: the sampling-table row whose sampling
                                       state applies to it (bound with ``set_request``)
copy_src/copy_dst  [C] int32           whole-block copy-on-write copies, run before the step
num_seqs           int                 S
num_tokens         int                 T
decode_only        bool                every sequence has exactly one new token (the
                                       decode-specialized attention applies)
token_bitmask      [S', W] int32       optional: allowed tokens of each sampled row (structured
                                       outputs; W = ceil(vocab / 32), see
                                       :mod:`kvpage.sampling.token_bitmask`); None allows all
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
    decode_only: bool


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
    decode_only: bool | None = None  # None: derived from cu_q_lens

    def __post_init__(self) -> None:
        if self.num_seqs < 0:
            self.num_seqs = len(self.kv_lens)
        if self.num_tokens < 0:
            self.num_tokens = len(self.token_ids)
        if self.decode_only is None:
            s = self.num_seqs
            self.decode_only = self.num_tokens == s and bool(
                np.all(np.diff(self.cu_q_lens[: s + 1]) == 1)
            )
