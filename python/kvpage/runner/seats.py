"""Seats: binding requests to rows of the device sampling table.

This file owns :class:`Seats`: :meth:`~Seats.set_request`'s checks and its write of one
row of the runner's :class:`~kvpage.sampling.table.SamplingTable` (one call of the
seat-writer executable, never a recompile; the row itself:
:func:`~kvpage.sampling.table.seat_row`), and the one per-seat fact the host keeps: how
many top logprobs the seat's request asked for, which decides whether a step returns
top-logprob lists at all (:meth:`~Seats.want_top`).

A seat is a row of the sampling table, ``0 <= seat < max_num_seqs`` (the id spaces:
:mod:`kvpage.runner.protocol`); a plan's ``sample_rows`` are seats.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvpage.runner.placement import Placement
from kvpage.runner.step_executables import StepExecutables
from kvpage.sampling.device_params import DeviceSamplingParams
from kvpage.sampling.table import seat_row

if TYPE_CHECKING:
    from kvpage.runner.runner_state import RunnerState


class Seats:
    """The seats of one :class:`~kvpage.runner.model_runner.ModelRunner` (held weakly);
    writes its ``sampling_table``."""

    def __init__(
        self, runner: RunnerState, executables: StepExecutables, placement: Placement
    ) -> None:
        self._r: RunnerState = weakref.proxy(runner)
        self._exec = executables
        self._place = placement
        self.top_logprobs = np.zeros(runner.max_num_seqs + 1, np.int32)
        """Top logprobs asked for by the request at each seat (0: none; the last entry is
        the padding row's)."""

    def set_request(
        self,
        seat: int,
        params: DeviceSamplingParams,
        prompt_token_ids: Sequence[int] | np.ndarray = (),
        output_token_ids: Sequence[int] | np.ndarray = (),
    ) -> None:
        """:meth:`ModelRunner.set_request <kvpage.runner.model_runner.ModelRunner.set_request>`."""
        r = self._r
        if not 0 <= seat < r.max_num_seqs:
            raise ValueError(f"seat {seat} out of range [0, {r.max_num_seqs})")
        if params.logprobs is not None and params.logprobs > r.max_logprobs:
            raise ValueError(
                f"logprobs={params.logprobs} exceeds this runner's max_logprobs "
                f"{r.max_logprobs}"
            )
        if params.uses_penalties and not r.enable_penalties:
            raise ValueError("penalties requested but the runner has enable_penalties=False")
        row = seat_row(
            seat, params, prompt_token_ids, output_token_ids, r.max_model_len,
            r.enable_penalties, r.config.vocab_size,
        )
        host = self._place.host_input
        r.sampling_table = self._exec.write_seat_fn()(
            r.sampling_table, *(host(value) for value in row)
        )
        self.top_logprobs[seat] = params.logprobs or 0

    def free_request(self, seat: int) -> None:
        """Forget a finished request's host-side flags (its device row is simply reused)."""
        self.top_logprobs[seat] = 0

    def reset(self) -> None:
        """Forget every seat (the sampling table was rebuilt)."""
        self.top_logprobs[:] = 0

    def want_top(self, seats: np.ndarray) -> bool:
        """Whether a step sampling at ``seats`` returns top-logprob lists (some request
        there asked for them)."""
        return self._r.max_logprobs > 0 and bool(
            len(seats) and self.top_logprobs[seats].max() > 0
        )
