"""What a step plan asks of the engine before it runs: free the seats the scheduler
freed, note the requests it schedules for the first time, and load each newly bound
seat with its sample's sampling parameters.

The scheduler owns seats (rows of the runner's sampling table, ``0 <= seat <
max_num_seqs``): it binds one to a sample when the sample is first sampled and frees
it when the sample leaves or is preempted; the plan says which (``sample_new_seat``,
``sample_rows``, ``freed_seats``). The engine keeps no seat state of its own.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from kvpage._core import StepPlan
    from kvpage.engine.context import EngineContext
    from kvpage.engine.requests import RequestTable


class PlanReader:
    __slots__ = ("_ctx", "_requests")

    def __init__(self, ctx: EngineContext, requests: RequestTable) -> None:
        self._ctx = ctx
        self._requests = requests

    def read(self, plan: StepPlan) -> None:
        """The plan's facts for the engine: seats the scheduler freed since the last
        plan, and requests scheduled for the first time (with their cache hits)."""
        runner = self._ctx.runner
        for seat in plan.freed_seats.tolist():
            runner.free_request(seat)
        if len(plan.first_scheduled):
            now = time.monotonic()
            by_handle = self._requests.by_handle
            for handle, cached in zip(
                plan.first_scheduled.tolist(), plan.first_scheduled_cached.tolist(), strict=True
            ):
                request = by_handle.get(handle)
                if request is not None:
                    request.metrics.first_scheduled_time = now
                    request.num_cached_tokens = cached

    def bind_seats(self, plan: StepPlan) -> None:
        """Load each newly bound seat of the plan with its sample's sampling
        parameters and token history (the scheduler chose the seat)."""
        if not plan.sample_new_seat.any():
            return
        ctx = self._ctx
        for row in np.flatnonzero(plan.sample_new_seat).tolist():
            handle, index = int(plan.sample_request[row]), int(plan.sample_index[row])
            request = self._requests.by_handle[handle]
            tokens = ctx.scheduler.sample_tokens(handle, index)
            assert tokens is not None, "a scheduled sample has tokens"
            device_params = request.params.device_params(ctx.eos_token_ids)
            if device_params.seed is not None and index > 0:
                # Seeded samples of one request differ from each other but replay exactly.
                device_params.seed = (device_params.seed * 0x9E3779B97F4A7C15 + index) % (1 << 63)
            ctx.runner.set_request(
                int(plan.sample_rows[row]), device_params, request.prompt_token_ids,
                tokens[len(request.prompt_token_ids) :],
            )
