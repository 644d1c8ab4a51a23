"""The step plan: the arrays one scheduler step hands to the model runner.

The format (every field's dtype, shape and meaning) is documented once, in
``rust/sched/step_plan.rs``: the Rust core builds the plan the engine passes straight to
the runner. :class:`StepPlanLike` names the fields the runner reads; any object with
them works (the runner only duck-types). :class:`StepPlan` is a plain Python
implementation of those fields for tests, tools and Python-side schedulers;
``tests/core/test_step_plan_contract.py`` checks it against a plan the Rust scheduler
produces.
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
    row_request: np.ndarray
    num_seqs: int
    num_tokens: int
    decode_only: bool


def _empty() -> np.ndarray:
    return np.zeros(0, np.int32)


@dataclass(slots=True)
class StepPlan:
    """A step plan built in Python (format: ``rust/sched/step_plan.rs``). ``num_seqs``,
    ``num_tokens`` and ``decode_only`` are derived from the arrays when not given;
    ``token_bitmask`` None allows every token."""

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
    row_request: np.ndarray = field(default_factory=_empty)
    """Request handle of each row (uint64; read only with LoRA, for the rows' adapters);
    left empty, every row's is 0."""
    num_seqs: int = -1
    num_tokens: int = -1
    token_bitmask: np.ndarray | None = None
    decode_only: bool | None = None  # None: derived from cu_q_lens

    def __post_init__(self) -> None:
        if self.num_seqs < 0:
            self.num_seqs = len(self.kv_lens)
        if self.num_tokens < 0:
            self.num_tokens = len(self.token_ids)
        if len(self.row_request) == 0:
            self.row_request = np.zeros(self.num_seqs, np.uint64)
        if self.decode_only is None:
            s = self.num_seqs
            self.decode_only = self.num_tokens == s and bool(
                np.all(np.diff(self.cu_q_lens[: s + 1]) == 1)
            )
