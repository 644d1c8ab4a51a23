"""Host-to-device packing of a step plan into one padded int32 buffer.

This file owns :class:`PackedLayout`: for one bucket (padded tokens T, padded sequences S,
fixed copy count C, max blocks per sequence M) it fixes where each plan array sits in a
single flat int32 buffer. The host fills a copy of a pre-padded template (a few numpy
slice assignments, one transfer per step); inside the jitted step :meth:`unpack` slices
the buffer back into arrays with static offsets.

Padding conventions (they never change a real output):

* padded tokens: id 0, position 0, slot = first slot of the scratch block;
* padded sequences: ``cu_q_lens`` repeats the last real value (q_len 0), ``kv_len`` 0,
  block-table rows all scratch;
* padded sampled rows: logits index 0, sample row = the sampling table's dummy row;
* padded copies: scratch block -> an out-of-range block id (dropped);
* LoRA slots (layouts with ``lora``): 0, the adapter stacks' zero entry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import jax
import numpy as np

from kvpage.model.decoder import AttentionMetadata
from kvpage.runner.step_plan import StepPlanLike

# Scalars at the end of the buffer.
_NUM_SEQS, _NUM_SAMPLED, _STEP_COUNTER, _WANT_TOP = range(4)
_NUM_SCALARS = 4


class StepArrays(NamedTuple):
    """The unpacked device arrays of one padded step."""

    token_ids: jax.Array
    positions: jax.Array
    meta: AttentionMetadata
    logits_indices: jax.Array
    sample_rows: jax.Array
    copy_src: jax.Array
    copy_dst: jax.Array
    num_sampled: jax.Array  # scalar
    step_counter: jax.Array  # scalar
    want_top_logprobs: jax.Array  # scalar bool
    lora_slots: jax.Array | None  # [T] each token's LoRA adapter slot (layouts with lora)


@dataclass(frozen=True, slots=True)
class PaddingValues:
    """Fill values for padded entries, fixed per runner."""

    scratch_slot: int
    scratch_block: int
    dummy_sample_row: int
    dropped_block: int


@dataclass(frozen=True, slots=True)
class PackedLayout:
    num_tokens: int
    num_seqs: int
    num_copies: int
    max_blocks: int
    lora: bool = False
    """Whether the buffer carries each token's LoRA adapter slot (after the scalars)."""

    # Offsets, in the order the buffer stores them.
    @property
    def _sizes(self) -> tuple[int, ...]:
        t, s, c, m = self.num_tokens, self.num_seqs, self.num_copies, self.max_blocks
        # token_ids, positions, slot_mapping, cu_q_lens, kv_lens, block_tables,
        # logits_indices, sample_rows, copy_src, copy_dst, scalars, lora_slots
        return (t, t, t, s + 1, s, s * m, s, s, c, c, _NUM_SCALARS, t if self.lora else 0)

    @property
    def offsets(self) -> tuple[int, ...]:
        out, pos = [], 0
        for size in self._sizes:
            out.append(pos)
            pos += size
        out.append(pos)
        return tuple(out)

    @property
    def step_counter_offset(self) -> int:
        """Where the step counter scalar sits in the buffer."""
        return self.offsets[10] + _STEP_COUNTER

    @property
    def size(self) -> int:
        return self.offsets[-1]

    def template(self, pad: PaddingValues) -> np.ndarray:
        """A buffer holding only padding; copy it and write the real values over it."""
        o = self.offsets
        buf = np.zeros(self.size, np.int32)
        buf[o[2] : o[3]] = pad.scratch_slot
        buf[o[5] : o[6]] = pad.scratch_block
        buf[o[7] : o[8]] = pad.dummy_sample_row
        buf[o[8] : o[9]] = pad.scratch_block
        buf[o[9] : o[10]] = pad.dropped_block
        return buf

    def pack(
        self,
        plan: StepPlanLike,
        template: np.ndarray,
        block_size: int,
        step_counter: int,
        want_top_logprobs: bool,
        include_copies: bool,
        lora_row_slots: np.ndarray | None = None,
    ) -> np.ndarray:
        """Fill a copy of ``template`` with ``plan`` (sizes already checked by the caller);
        with ``lora``, ``lora_row_slots`` (int32 ``[S]``, each row's adapter slot, 0 for
        none) is spread over the rows' tokens."""
        o = self.offsets
        buf = template.copy()
        t, s = int(plan.num_tokens), int(plan.num_seqs)
        buf[o[0] : o[0] + t] = plan.token_ids[:t]
        buf[o[1] : o[1] + t] = plan.positions[:t]
        buf[o[2] : o[2] + t] = plan.slot_mapping[:t]
        cu = plan.cu_q_lens
        buf[o[3] : o[3] + s + 1] = cu[: s + 1]
        buf[o[3] + s + 1 : o[4]] = cu[s]
        buf[o[4] : o[4] + s] = plan.kv_lens[:s]
        tables = np.asarray(plan.block_tables)[:s]
        width = min(tables.shape[1], self.max_blocks)
        if tables.shape[1] > self.max_blocks:
            needed = math.ceil(int(np.max(plan.kv_lens[:s], initial=0)) / block_size)
            if needed > self.max_blocks:
                raise ValueError(
                    f"a sequence needs {needed} blocks, more than max_blocks {self.max_blocks}"
                )
        view = buf[o[5] : o[6]].reshape(self.num_seqs, self.max_blocks)
        view[:s, :width] = tables[:, :width]
        n = len(plan.logits_indices)
        buf[o[6] : o[6] + n] = plan.logits_indices
        buf[o[7] : o[7] + n] = plan.sample_rows
        if include_copies:
            c = len(plan.copy_src)
            buf[o[8] : o[8] + c] = plan.copy_src
            buf[o[9] : o[9] + c] = plan.copy_dst
        scalars = buf[o[10] : o[11]]
        scalars[_NUM_SEQS] = s
        scalars[_NUM_SAMPLED] = n
        scalars[_STEP_COUNTER] = step_counter & 0x7FFFFFFF
        scalars[_WANT_TOP] = int(want_top_logprobs)
        if self.lora and lora_row_slots is not None:
            buf[o[11] : o[11] + t] = np.repeat(lora_row_slots[:s], np.diff(cu[: s + 1]))
        return buf

    def unpack(self, buf: jax.Array) -> StepArrays:
        """Slice a packed device buffer (inside jit; offsets are static)."""
        o = self.offsets

        def part(i: int) -> jax.Array:
            return buf[o[i] : o[i + 1]]

        scalars = part(10)
        meta = AttentionMetadata(
            slot_mapping=part(2),
            block_tables=part(5).reshape(self.num_seqs, self.max_blocks),
            kv_lens=part(4),
            cu_q_lens=part(3),
            num_seqs=scalars[_NUM_SEQS : _NUM_SEQS + 1],
        )
        return StepArrays(
            token_ids=part(0),
            positions=part(1),
            meta=meta,
            logits_indices=part(6),
            sample_rows=part(7),
            copy_src=part(8),
            copy_dst=part(9),
            num_sampled=scalars[_NUM_SAMPLED],
            step_counter=scalars[_STEP_COUNTER],
            want_top_logprobs=scalars[_WANT_TOP] != 0,
            lora_slots=part(11) if self.lora else None,
        )
